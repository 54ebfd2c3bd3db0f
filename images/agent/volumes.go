// volumes: copies of the kubelet's atomic-writer volumes (ConfigMap, Secret, projected, downward
// API), kept in the guest's /run (a tmpfs) with the kubelet's own layout (protocol version 6).
//
// A volume is <volumesDir>/<id>/: a version directory ..<timestamp>/ holding the files, ..data a
// symlink to it, and each user-visible name a symlink <name> -> ..data/<name>. The host sends a
// new version as volume_begin (is it the current one already?), volume_write (its directories
// and files, parents first, large files in parts) and volume_commit, which swaps ..data by
// renaming a new link over it, as the kubelet's atomic writer does: a reader that follows
// <name> sees the old version or the new one whole, never a mix. Owners and modes are the host's.
package main

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
)

const dataLink = "..data"

// volumesDir holds the copies (a variable for the tests).
var volumesDir = "/run/vmsandbox/volumes"

var (
	volumeIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)
	versionPattern  = regexp.MustCompile(`^\.\.[0-9A-Za-z_.-]{1,128}$`)
	volumesMu       sync.Mutex
)

type volumeMeta struct {
	Mode uint32 `json:"mode"`
	UID  int    `json:"uid"`
	GID  int    `json:"gid"`
}

type volumeEntry struct {
	Path   string `json:"path"`
	Type   string `json:"type"` // dir | file
	Offset int64  `json:"offset"`
	Data   string `json:"data"` // base64, files only
	volumeMeta
}

type volumeArgs struct {
	Volume  string        `json:"volume"`
	Version string        `json:"version"`
	Entries []volumeEntry `json:"entries"`
	Root    volumeMeta    `json:"root"`
	Top     volumeMeta    `json:"top"`
	Names   []string      `json:"names"`
}

func parseVolumeArgs(op string, raw json.RawMessage, needVersion bool) (volumeArgs, string, error) {
	var a volumeArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return a, "", fmt.Errorf("%s: %v", op, err)
	}
	if !volumeIDPattern.MatchString(a.Volume) {
		return a, "", fmt.Errorf("%s: bad volume id %q", op, a.Volume)
	}
	if needVersion && (!versionPattern.MatchString(a.Version) || a.Version == dataLink) {
		return a, "", fmt.Errorf("%s: bad version %q", op, a.Version)
	}
	return a, filepath.Join(volumesDir, a.Volume), nil
}

// volumeName reports whether name may be one path component of a volume's file.
func volumeName(name string) bool {
	return name != "" && name != "." && name != ".." && len(name) <= 255 && !strings.ContainsAny(name, "/\x00")
}

// volumeRel is rel below dir, each component a volumeName, or an error.
func volumeRel(dir, rel string) (string, error) {
	parts := strings.Split(rel, "/")
	if len(parts) > 33 {
		return "", fmt.Errorf("path %q is too deep", rel)
	}
	for _, p := range parts {
		if !volumeName(p) {
			return "", fmt.Errorf("bad path %q", rel)
		}
	}
	return filepath.Join(dir, filepath.Join(parts...)), nil
}

func setMeta(path string, m volumeMeta) error {
	if err := os.Lchown(path, m.UID, m.GID); err != nil {
		return err
	}
	// syscall's mode keeps the setuid, setgid and sticky bits where os.FileMode would not
	return syscall.Chmod(path, m.Mode&0o7777)
}

func currentVersion(dir string) string {
	target, err := os.Readlink(filepath.Join(dir, dataLink))
	if err != nil {
		return ""
	}
	if st, err := os.Lstat(filepath.Join(dir, target)); err != nil || !st.IsDir() {
		return ""
	}
	return target
}

// opVolumeBegin: {"current": true} when the volume's ..data already names this version (the host
// need send nothing); otherwise an empty version directory is made, replacing what an earlier
// unfinished attempt left.
func opVolumeBegin(raw json.RawMessage) (interface{}, error) {
	a, dir, err := parseVolumeArgs("volume_begin", raw, true)
	if err != nil {
		return nil, err
	}
	volumesMu.Lock()
	defer volumesMu.Unlock()
	if currentVersion(dir) == a.Version {
		return map[string]interface{}{"current": true}, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("volume_begin: %v", err)
	}
	staging := filepath.Join(dir, a.Version)
	if err := os.RemoveAll(staging); err != nil {
		return nil, fmt.Errorf("volume_begin: %v", err)
	}
	if err := os.Mkdir(staging, 0o700); err != nil {
		return nil, fmt.Errorf("volume_begin: %v", err)
	}
	return map[string]interface{}{"current": false}, nil
}

func writeVolumeEntry(staging string, e volumeEntry) error {
	path, err := volumeRel(staging, e.Path)
	if err != nil {
		return err
	}
	switch e.Type {
	case "dir":
		if err := os.Mkdir(path, 0o700); err != nil {
			return err
		}
		return setMeta(path, e.volumeMeta)
	case "file":
	default:
		return fmt.Errorf("%s: bad type %q", e.Path, e.Type)
	}
	data, err := base64.StdEncoding.DecodeString(e.Data)
	if err != nil {
		return fmt.Errorf("%s: data: %v", e.Path, err)
	}
	flags := os.O_WRONLY | syscall.O_NOFOLLOW
	if e.Offset == 0 {
		flags |= os.O_CREATE | os.O_EXCL
	}
	f, err := os.OpenFile(path, flags, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	end, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	if end != e.Offset {
		return fmt.Errorf("%s: part at offset %d, but the file holds %d bytes", e.Path, e.Offset, end)
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := f.Chown(e.UID, e.GID); err != nil {
		return err
	}
	return syscall.Fchmod(int(f.Fd()), e.Mode&0o7777)
}

func opVolumeWrite(raw json.RawMessage) (interface{}, error) {
	a, dir, err := parseVolumeArgs("volume_write", raw, true)
	if err != nil {
		return nil, err
	}
	volumesMu.Lock()
	defer volumesMu.Unlock()
	staging := filepath.Join(dir, a.Version)
	if currentVersion(dir) == a.Version {
		return nil, errors.New("volume_write: that version is committed already")
	}
	for _, e := range a.Entries {
		if err := writeVolumeEntry(staging, e); err != nil {
			return nil, fmt.Errorf("volume_write: %v", err)
		}
	}
	return nil, nil
}

// opVolumeCommit makes the staged version the volume's: ..data swapped by rename, the names linked,
// names the new version lacks unlinked, older versions removed, owners and modes set.
func opVolumeCommit(raw json.RawMessage) (interface{}, error) {
	a, dir, err := parseVolumeArgs("volume_commit", raw, true)
	if err != nil {
		return nil, err
	}
	names := map[string]bool{}
	for _, n := range a.Names {
		if !volumeName(n) || strings.HasPrefix(n, "..") {
			return nil, fmt.Errorf("volume_commit: bad name %q", n)
		}
		names[n] = true
	}
	volumesMu.Lock()
	defer volumesMu.Unlock()
	staging := filepath.Join(dir, a.Version)
	if st, err := os.Lstat(staging); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("volume_commit: version %s was not begun", a.Version)
	}
	if err := setMeta(staging, a.Top); err != nil {
		return nil, fmt.Errorf("volume_commit: %v", err)
	}
	tmp := filepath.Join(dir, "..data_tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(a.Version, tmp); err != nil {
		return nil, fmt.Errorf("volume_commit: %v", err)
	}
	// the links are the volume directory's owner's, as the kubelet's are: in a sticky directory
	// (a projected volume's tmpfs is 1777) the kernel follows only a link of the directory's owner
	// or of the follower, and a container in a user namespace maps neither the agent's root
	if err := os.Lchown(tmp, a.Root.UID, a.Root.GID); err != nil {
		return nil, fmt.Errorf("volume_commit: %v", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, dataLink)); err != nil {
		return nil, fmt.Errorf("volume_commit: %v", err)
	}
	for n := range names {
		link := filepath.Join(dir, n)
		if _, err := os.Lstat(link); err == nil {
			continue
		}
		if err := os.Symlink(dataLink+"/"+n, link); err != nil {
			return nil, fmt.Errorf("volume_commit: %v", err)
		}
		if err := os.Lchown(link, a.Root.UID, a.Root.GID); err != nil {
			return nil, fmt.Errorf("volume_commit: %v", err)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("volume_commit: %v", err)
	}
	for _, e := range entries {
		name := e.Name()
		switch {
		case name == dataLink || name == a.Version:
		case e.Type()&os.ModeSymlink != 0 && !names[name]:
			if target, err := os.Readlink(filepath.Join(dir, name)); err == nil && strings.HasPrefix(target, dataLink+"/") {
				_ = os.Remove(filepath.Join(dir, name))
			}
		case e.IsDir() && versionPattern.MatchString(name):
			_ = os.RemoveAll(filepath.Join(dir, name))
		}
	}
	if err := setMeta(dir, a.Root); err != nil {
		return nil, fmt.Errorf("volume_commit: %v", err)
	}
	return nil, nil
}

func opVolumeRemove(raw json.RawMessage) (interface{}, error) {
	_, dir, err := parseVolumeArgs("volume_remove", raw, false)
	if err != nil {
		return nil, err
	}
	volumesMu.Lock()
	defer volumesMu.Unlock()
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("volume_remove: %v", err)
	}
	return nil, nil
}

func init() {
	handlers["volume_begin"] = opVolumeBegin
	handlers["volume_write"] = opVolumeWrite
	handlers["volume_commit"] = opVolumeCommit
	handlers["volume_remove"] = opVolumeRemove
}
