package main

// A container in a user namespace of its pod's own (Kubernetes' hostUsers: false): crun makes the
// namespace from the spec's linux.uidMappings/gidMappings; here its root file system is made usable
// by the mapped ids. The image's read-only disk is cloned as an idmapped mount (open_tree +
// mount_setattr MOUNT_ATTR_IDMAP with a user namespace of the same mappings) and that clone is the
// overlay's lower layer, so the image's root-owned files are the container's root's, and what
// overlay copies up keeps the mapped owner; the writable layer's own root takes the lower root's
// (mapped) owner and mode. A tree shared over 9p cannot be idmapped (9p does not allow it) and is
// refused for such a container.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"unsafe"
)

const (
	sysOpenTree                = 428
	sysMoveMount               = 429
	sysMountSetattr            = 442
	openTreeClone              = 0x1
	openTreeCloexec            = 0o2000000
	atEmptyPath                = 0x1000
	atRecursive                = 0x8000
	mountAttrIdmap             = 0x00100000
	moveMountFEmptyPath        = 0x4
	maxMappings                = 32
	idLimit             uint64 = 1 << 32
)

type mountAttr struct {
	attrSet     uint64
	attrClr     uint64
	propagation uint64
	usernsFd    uint64
}

// specMappings returns the spec's uid and gid mappings when it gives the container a user
// namespace (nil, nil, nil when it does not), checked as the kernel checks them.
func specMappings(spec map[string]interface{}) ([]syscall.SysProcIDMap, []syscall.SysProcIDMap, error) {
	linux, _ := spec["linux"].(map[string]interface{})
	if linux == nil {
		return nil, nil, nil
	}
	namespaces, _ := linux["namespaces"].([]interface{})
	user := false
	for _, n := range namespaces {
		if m, ok := n.(map[string]interface{}); ok && m["type"] == "user" {
			if p, has := m["path"]; has && p != "" {
				return nil, nil, errors.New("create: joining an existing user namespace (a path) is not supported")
			}
			user = true
		}
	}
	if !user {
		return nil, nil, nil
	}
	uids, err := parseMappings(linux["uidMappings"], "uidMappings")
	if err != nil {
		return nil, nil, err
	}
	gids, err := parseMappings(linux["gidMappings"], "gidMappings")
	if err != nil {
		return nil, nil, err
	}
	return uids, gids, nil
}

func parseMappings(v interface{}, name string) ([]syscall.SysProcIDMap, error) {
	items, _ := v.([]interface{})
	if len(items) == 0 || len(items) > maxMappings {
		return nil, fmt.Errorf("create: a user namespace needs 1 to %d %s, not %d", maxMappings, name, len(items))
	}
	out := make([]syscall.SysProcIDMap, 0, len(items))
	for i, it := range items {
		m, _ := it.(map[string]interface{})
		var vals [3]uint64
		for j, key := range []string{"containerID", "hostID", "size"} {
			f, ok := m[key].(float64)
			if !ok || f < 0 || f != float64(uint64(f)) || uint64(f) >= idLimit {
				return nil, fmt.Errorf("create: %s[%d].%s is not an id", name, i, key)
			}
			vals[j] = uint64(f)
		}
		if vals[2] == 0 || vals[0]+vals[2] >= idLimit || vals[1]+vals[2] >= idLimit {
			return nil, fmt.Errorf("create: %s[%d] is empty or passes the last id", name, i)
		}
		out = append(out, syscall.SysProcIDMap{ContainerID: int(vals[0]), HostID: int(vals[1]), Size: int(vals[2])})
	}
	return out, nil
}

// usernsFd returns an open /proc/PID/ns/user of a user namespace with the mappings (a short-lived
// child made in it, which exits once the namespace is open).
func usernsFd(uids, gids []syscall.SysProcIDMap) (*os.File, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, holdArg)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER, UidMappings: uids, GidMappings: gids}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := startTracked(cmd); err != nil {
		return nil, fmt.Errorf("a user namespace for the idmapped root: %v", err)
	}
	f, openErr := os.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid))
	stdin.Close()
	waitTracked(cmd)
	if openErr != nil {
		return nil, openErr
	}
	return f, nil
}

// holdArg makes the agent's binary wait for its stdin to close and exit (the child usernsFd makes).
const holdArg = "--hold-userns"

func holdUserns() {
	b := make([]byte, 1)
	for {
		if _, err := os.Stdin.Read(b); err != nil {
			os.Exit(0)
		}
	}
}

// idmappedClone mounts at target a clone of the mount at source, idmapped with the mappings.
func idmappedClone(source, target string, uids, gids []syscall.SysProcIDMap) error {
	ns, err := usernsFd(uids, gids)
	if err != nil {
		return err
	}
	defer ns.Close()
	src, err := syscall.BytePtrFromString(source)
	if err != nil {
		return err
	}
	r, _, errno := syscall.Syscall(sysOpenTree, uintptr(0xffffffffffffff9c) /* AT_FDCWD */, uintptr(unsafe.Pointer(src)),
		openTreeClone|openTreeCloexec)
	if errno != 0 {
		return fmt.Errorf("open_tree %s: %v", source, errno)
	}
	tree := int(r)
	defer syscall.Close(tree)
	attr := mountAttr{attrSet: mountAttrIdmap, usernsFd: uint64(ns.Fd())}
	empty, _ := syscall.BytePtrFromString("")
	if _, _, errno := syscall.Syscall6(sysMountSetattr, uintptr(tree), uintptr(unsafe.Pointer(empty)), atEmptyPath,
		uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr), 0); errno != 0 {
		return fmt.Errorf("idmap the mount of %s (mount_setattr): %v", source, errno)
	}
	dst, err := syscall.BytePtrFromString(target)
	if err != nil {
		return err
	}
	if _, _, errno := syscall.Syscall6(sysMoveMount, uintptr(tree), uintptr(unsafe.Pointer(empty)),
		uintptr(0xffffffffffffff9c), uintptr(unsafe.Pointer(dst)), moveMountFEmptyPath, 0); errno != 0 {
		return fmt.Errorf("move_mount onto %s: %v", target, errno)
	}
	return nil
}

// idmappedLower returns the lower layer a container in a user namespace gets: an idmapped clone of
// its image disk's mount at dir/lower, and gives the writable layer's root (dir/upper) the owner
// and mode the idmapped lower root has.
func idmappedLower(lowerName, lower, dir string, uids, gids []syscall.SysProcIDMap) (string, error) {
	if len(lowerName) < 6 || lowerName[:6] != "disks/" {
		return "", fmt.Errorf("create: a container in a user namespace of its own needs its image on a disk "+
			"(disks/SERIAL); %q is shared over 9p, which cannot be idmapped", lowerName)
	}
	// the spec binds the guest's mqueue (the container cannot mount one of the guest's IPC namespace)
	if err := ensureMqueue(); err != nil {
		return "", err
	}
	target := dir + "/lower"
	if err := os.MkdirAll(target, 0o755); err != nil {
		return "", err
	}
	if err := idmappedClone(lower, target, uids, gids); err != nil {
		return "", fmt.Errorf("create: %v", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(target, &st); err != nil {
		return "", err
	}
	upper := dir + "/upper"
	if err := os.Lchown(upper, int(st.Uid), int(st.Gid)); err != nil {
		return "", err
	}
	if err := syscall.Chmod(upper, st.Mode&0o7777); err != nil {
		return "", err
	}
	return target, nil
}

// ensureMqueue mounts the guest's POSIX message queue file system at /dev/mqueue once.
func ensureMqueue() error {
	mountMu.Lock()
	defer mountMu.Unlock()
	if mounted["mqueue"] {
		return nil
	}
	if err := os.MkdirAll("/dev/mqueue", 0o755); err != nil {
		return err
	}
	if err := syscall.Mount("mqueue", "/dev/mqueue", "mqueue", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil && !errors.Is(err, syscall.EBUSY) {
		return fmt.Errorf("create: mount the guest's mqueue at /dev/mqueue: %v", err)
	}
	mounted["mqueue"] = true
	return nil
}
