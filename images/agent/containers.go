package main

// Containers: OCI bundles run with crun, their root file systems an overlay of a read-only lower
// tree (an image's read-only virtio-blk disk, or a tree shared in from the host over virtio-9p;
// idmapped for a container in a user namespace of its own: userns.go) and
// a writable layer in guest memory; their output
// is kept in the guest in the CRI log format until the host reads it over the channel (logbuf.go).

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	sharedTag   = "vmsandbox.shared"
	sharedMount = "/run/vmsandbox/shared"
	imagesTag   = "vmsandbox.images"
	imagesMount = "/run/vmsandbox/images"
	disksMount  = "/run/vmsandbox/disks"
	stateDir    = "/run/vmsandbox/containers"
	crunRoot    = "/run/crun"
	cgroupBase  = "/sys/fs/cgroup"
	// A log line longer than this is cut into partial (P) lines, as the kubelet's runtimes do.
	maxLogLine = 16 * 1024
)

var (
	idPattern = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,127}$`)
	// the serial of an image disk (virtio-blk serials are at most 20 bytes)
	serialPattern = regexp.MustCompile(`^[a-z0-9]{1,20}$`)
)

type container struct {
	ID         string `json:"id"`
	State      string `json:"state"` // created | running | exited
	Pid        int    `json:"pid"`
	ExitCode   int    `json:"exit_code"`
	Signal     int    `json:"signal"`
	OOMKilled  bool   `json:"oom_killed"`
	CreatedAt  int64  `json:"created_at_ns"`
	StartedAt  int64  `json:"started_at_ns"`
	FinishedAt int64  `json:"finished_at_ns"`
	Error      string `json:"error,omitempty"`

	cgroup string
	spec   map[string]interface{}
	log    *logBuffer
	logs   sync.WaitGroup
	done   chan struct{}
	made   chan struct{} // closed once its create answered (it is created, or failed and forgotten)

	stdinMu   sync.Mutex
	stdin     *os.File // write end of the container's stdin pipe, or its terminal's master (Attach); nil when none or closed
	stdinOnce bool
	stdinUsed bool
	stdinNL   bool     // the last byte written to a terminal's input ended a line
	master    *os.File // the terminal's master (tty containers); its pump closes it
}

var (
	cmu        sync.Mutex
	containers = map[string]*container{}
	mountMu    sync.Mutex
	mounted    = map[string]bool{}
	diskMounts = map[string]string{} // image disk serial -> the block device (vdX) mounted for it
)

// ensureMount mounts the 9p share with tag at dir once (read-only for the image trees).
func ensureMount(tag, dir string, readonly bool) error {
	mountMu.Lock()
	defer mountMu.Unlock()
	if mounted[tag] {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var flags uintptr
	if readonly {
		flags = syscall.MS_RDONLY
	}
	opts := "trans=virtio,version=9p2000.L,msize=262144,cache=none"
	if err := syscall.Mount(tag, dir, "9p", flags, opts); err != nil {
		return fmt.Errorf("mount the host directory with 9p tag %s: %v", tag, err)
	}
	mounted[tag] = true
	return nil
}

func ensureShared() error { return ensureMount(sharedTag, sharedMount, false) }

func cleanRel(rel string) (string, error) {
	clean := filepath.Clean("/" + rel)
	if rel == "" || clean == "/" || strings.Contains(rel, "..") {
		return "", fmt.Errorf("bad path %q", rel)
	}
	return clean, nil
}

// diskWait bounds how long a lower's disk may take to appear after the host attached it (a
// hot-plugged virtio-blk device is probed by the guest's PCI hotplug and virtio_blk asynchronously).
const diskWait = 20 * time.Second

// findDisk returns /dev/<name> of the virtio-blk disk whose serial is serial, waiting up to
// diskWait for it to appear. The serial is the host's name for the disk, so the guest's probe
// order does not matter.
func findDisk(serial string) (string, error) {
	deadline := time.Now().Add(diskWait)
	for {
		names, _ := filepath.Glob("/sys/block/vd*/serial")
		for _, f := range names {
			b, err := os.ReadFile(f)
			if err == nil && strings.TrimSpace(string(b)) == serial {
				return "/dev/" + filepath.Base(filepath.Dir(f)), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no disk with serial %q after %v", serial, diskWait)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ensureDisk mounts the image disk with serial read-only at disksMount/<serial> once: EROFS, or
// ext4 (without journal replay) for disks made that way.
func ensureDisk(serial string) (string, error) {
	dir := filepath.Join(disksMount, serial)
	mountMu.Lock()
	defer mountMu.Unlock()
	if dev, ok := diskMounts[serial]; ok {
		b, err := os.ReadFile("/sys/block/" + dev + "/serial")
		if err == nil && strings.TrimSpace(string(b)) == serial {
			return dir, nil
		}
		// the host detached the disk (a failed create's rollback) and may have attached it again:
		// the old mount reads a device that is gone
		_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		delete(diskMounts, serial)
	}
	dev, err := findDisk(serial)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	flags := uintptr(syscall.MS_RDONLY | syscall.MS_NODEV)
	if err := syscall.Mount(dev, dir, "erofs", flags, ""); err != nil {
		if err2 := syscall.Mount(dev, dir, "ext4", flags, "noload"); err2 != nil {
			return "", fmt.Errorf("mount image disk %s (%s): erofs: %v; ext4: %v", serial, dev, err, err2)
		}
	}
	diskMounts[serial] = filepath.Base(dev)
	return dir, nil
}

// lowerPath is a tree named "shared/<rel>" (in the sandbox's shared directory), "images/<rel>"
// (in the host's read-only image trees) or "disks/<serial>" (the root of an image's read-only
// disk).
func lowerPath(name string) (string, error) {
	first, rest, _ := strings.Cut(name, "/")
	if first == "disks" {
		if !serialPattern.MatchString(rest) {
			return "", fmt.Errorf("bad disk serial %q", rest)
		}
		return ensureDisk(rest)
	}
	clean, err := cleanRel(rest)
	if err != nil {
		return "", err
	}
	switch first {
	case "shared":
		return sharedMount + clean, ensureShared()
	case "images":
		return imagesMount + clean, ensureMount(imagesTag, imagesMount, true)
	}
	return "", fmt.Errorf("bad lower tree %q (want shared/..., images/... or disks/SERIAL)", name)
}

// lookup returns container id once its create has answered: a container is created, running or
// exited (the protocol's states), never "creating", so an op on one whose create is still under way
// waits for that create, and finds the container created or no container.
func lookup(id string) (*container, error) {
	cmu.Lock()
	c, ok := containers[id]
	cmu.Unlock()
	if !ok {
		return nil, errUnknownContainer{id}
	}
	<-c.made
	cmu.Lock()
	defer cmu.Unlock()
	if containers[id] != c {
		return nil, errUnknownContainer{id}
	}
	return c, nil
}

func (c *container) snapshot() container {
	cmu.Lock()
	defer cmu.Unlock()
	return container{ID: c.ID, State: c.State, Pid: c.Pid, ExitCode: c.ExitCode, Signal: c.Signal,
		OOMKilled: c.OOMKilled, CreatedAt: c.CreatedAt, StartedAt: c.StartedAt, FinishedAt: c.FinishedAt,
		Error: c.Error}
}

func crun(args ...string) ([]byte, error) {
	cmd := exec.Command("/usr/bin/crun", append([]string{"--root", crunRoot}, args...)...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := runTracked(cmd)
	if err != nil {
		return out.Bytes(), fmt.Errorf("crun %s: %v: %s", args[0], err, clip(out.String(), 2000))
	}
	return out.Bytes(), nil
}

func clip(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

type createArgs struct {
	ID    string                 `json:"id"`
	Lower string                 `json:"lower"`
	Spec  map[string]interface{} `json:"spec"`
	// a pipe for the container's stdin, which Attach sessions write to; closed after the first
	// session with stdin_once
	Stdin     bool `json:"stdin"`
	StdinOnce bool `json:"stdin_once"`
	// tty: the process gets a terminal (crun hands its master over a console socket); its one
	// output stream is logged as stdout, as containerd logs a container with a terminal
	TTY bool `json:"tty"`
	// image volumes (protocol 7): the spec's bind mount at each destination gets its source here
	ImageMounts []imageMount `json:"image_mounts"`
}

// imageMount is an image volume: sub_path of the image disk whose serial is serial, bound at
// destination.
type imageMount struct {
	Destination string `json:"destination"`
	Serial      string `json:"serial"`
	SubPath     string `json:"sub_path"`
}

// maxLinks bounds the symlinks one sub path's resolution follows (as the kernel's ELOOP does).
const maxLinks = 40

// resolveInTree is sub (relative, no "..") inside the tree at root, every symlink on the way
// resolved as if root were "/" (an absolute target starts again at root, ".." stops at root), so
// no link leads out of the tree; the result has no symlink left in it and exists. The tree is
// a read-only image disk's, so it cannot change between this walk and the bind.
func resolveInTree(root, sub string) (string, error) {
	if strings.HasPrefix(sub, "/") {
		return "", fmt.Errorf("sub path %q is not relative", sub)
	}
	for _, part := range strings.Split(sub, "/") {
		if part == ".." {
			return "", fmt.Errorf("sub path %q leaves the image ('..')", sub)
		}
	}
	var done []string
	todo := strings.Split(sub, "/")
	links := 0
	for len(todo) > 0 {
		part := todo[0]
		todo = todo[1:]
		switch part {
		case "", ".":
			continue
		case "..":
			if len(done) > 0 {
				done = done[:len(done)-1]
			}
			continue
		}
		p := filepath.Join(append([]string{root}, append(done, part)...)...)
		fi, err := os.Lstat(p)
		if err != nil {
			return "", fmt.Errorf("sub path %q: %v", sub, err)
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			if len(todo) > 0 && !fi.IsDir() {
				return "", fmt.Errorf("sub path %q: %s is not a directory", sub, filepath.Join(append(done, part)...))
			}
			done = append(done, part)
			continue
		}
		links++
		if links > maxLinks {
			return "", fmt.Errorf("sub path %q: more than %d symlinks", sub, maxLinks)
		}
		target, err := os.Readlink(p)
		if err != nil {
			return "", fmt.Errorf("sub path %q: %v", sub, err)
		}
		if strings.HasPrefix(target, "/") {
			done = nil
		}
		todo = append(strings.Split(target, "/"), todo...)
	}
	return filepath.Join(append([]string{root}, done...)...), nil
}

// setImageMounts mounts each image volume's disk and sets, as the source of the spec's one bind
// mount at its destination, its sub path resolved inside the disk's tree.
func setImageMounts(spec map[string]interface{}, mounts []imageMount) error {
	list, _ := spec["mounts"].([]interface{})
	for _, im := range mounts {
		if !serialPattern.MatchString(im.Serial) {
			return fmt.Errorf("create: image mount: bad disk serial %q", im.Serial)
		}
		if !strings.HasPrefix(im.Destination, "/") {
			return fmt.Errorf("create: image mount: destination %q is not absolute", im.Destination)
		}
		root, err := ensureDisk(im.Serial)
		if err != nil {
			return fmt.Errorf("create: image mount at %s: %v", im.Destination, err)
		}
		source, err := resolveInTree(root, im.SubPath)
		if err != nil {
			return fmt.Errorf("create: image mount at %s: %v", im.Destination, err)
		}
		found := 0
		for _, item := range list {
			m, _ := item.(map[string]interface{})
			if m != nil && m["destination"] == im.Destination && m["type"] == "bind" {
				m["source"] = source
				found++
			}
		}
		if found != 1 {
			return fmt.Errorf("create: image mount at %s: the spec has %d bind mounts there, not one", im.Destination, found)
		}
	}
	return nil
}

func opCreate(raw json.RawMessage) (interface{}, error) {
	var a createArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("create: %v", err)
	}
	if !idPattern.MatchString(a.ID) {
		return nil, fmt.Errorf("create: bad container id %q", a.ID)
	}
	if a.Spec == nil {
		return nil, errors.New("create: no spec")
	}
	if err := ensureShared(); err != nil {
		return nil, err
	}
	lower, err := lowerPath(a.Lower)
	if err != nil {
		return nil, err
	}
	if err := setImageMounts(a.Spec, a.ImageMounts); err != nil {
		return nil, err
	}
	cmu.Lock()
	if _, dup := containers[a.ID]; dup {
		cmu.Unlock()
		return nil, fmt.Errorf("create: container %q exists", a.ID)
	}
	streams := 2
	if a.TTY {
		streams = 1
	}
	c := &container{ID: a.ID, State: "creating", spec: a.Spec, log: newLogBuffer(streams), done: make(chan struct{}),
		made: make(chan struct{})}
	containers[a.ID] = c
	cmu.Unlock()
	defer close(c.made)
	fail := func(err error) (interface{}, error) {
		cleanup(a.ID)
		cmu.Lock()
		delete(containers, a.ID)
		cmu.Unlock()
		return nil, err
	}

	dir := filepath.Join(stateDir, a.ID)
	rootfs := filepath.Join(dir, "rootfs")
	for _, d := range []string{"upper", "work", "rootfs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return fail(err)
		}
	}
	uids, gids, err := specMappings(a.Spec)
	if err != nil {
		return fail(err)
	}
	if uids != nil {
		if lower, err = idmappedLower(a.Lower, lower, dir, uids, gids); err != nil {
			return fail(err)
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", lower, dir, dir)
	if err := syscall.Mount("overlay", rootfs, "overlay", 0, opts); err != nil {
		return fail(fmt.Errorf("create: overlay over %s: %v", a.Lower, err))
	}
	c.cgroup = "/vmsandbox/" + a.ID
	a.Spec["root"] = map[string]interface{}{"path": rootfs, "readonly": readonlyRoot(a.Spec)}
	linux, _ := a.Spec["linux"].(map[string]interface{})
	if linux == nil {
		linux = map[string]interface{}{}
		a.Spec["linux"] = linux
	}
	linux["cgroupsPath"] = c.cgroup
	if err := applySysctls(linux); err != nil {
		return fail(err)
	}
	if proc, ok := a.Spec["process"].(map[string]interface{}); ok {
		proc["terminal"] = a.TTY
	} else if a.TTY {
		return fail(errors.New("create: tty asked but the spec has no process"))
	}
	b, err := json.Marshal(a.Spec)
	if err != nil {
		return fail(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
		return fail(err)
	}
	pidFile := filepath.Join(dir, "pid")
	cmd := exec.Command("/usr/bin/crun", "--root", crunRoot, "create", "--no-pivot",
		"--bundle", dir, "--pid-file", pidFile, a.ID)
	// crun's own messages go to its log, not to the container's stderr
	cmd.Args = append(cmd.Args[:3], append([]string{"--log", filepath.Join(dir, "crun.log")}, cmd.Args[3:]...)...)
	var cio containerIO
	if a.TTY {
		err = cio.terminal(cmd, dir)
	} else {
		err = cio.pipes(cmd, a.Stdin)
	}
	if err != nil {
		cio.closeAll()
		return fail(fmt.Errorf("create: %v", err))
	}
	reap.Lock()
	reap.creating++ // the container's pid is tracked once read from the pid file
	reap.Unlock()
	defer func() {
		reap.Lock()
		reap.creating--
		reap.Unlock()
	}()
	runErr := runTracked(cmd)
	cio.closeChildEnds()
	if runErr == nil && a.TTY {
		if runErr = cio.takeMaster(); runErr != nil {
			crun("delete", "--force", a.ID) // created, but nobody would hold its terminal
		}
	}
	if runErr != nil {
		cio.closeAll()
		crunLog, _ := os.ReadFile(filepath.Join(dir, "crun.log"))
		return fail(fmt.Errorf("crun create: %v: %s", runErr, clip(string(crunLog), 2000)))
	}
	pidText, err := os.ReadFile(pidFile)
	if err != nil {
		cio.closeAll()
		return fail(err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(pidText)))
	track(pid)
	if a.TTY {
		c.master = cio.master
		if a.Stdin {
			c.stdin, c.stdinOnce, c.stdinNL = cio.master, a.StdinOnce, true
		}
		c.logs.Add(1)
		go pump(cio.master, "stdout", c.log, &c.logs, attachTee(c, 0))
	} else {
		c.stdin, c.stdinOnce = cio.stdinW, a.StdinOnce
		c.logs.Add(2)
		go pump(cio.outR, "stdout", c.log, &c.logs, attachTee(c, 0))
		go pump(cio.errR, "stderr", c.log, &c.logs, attachTee(c, 1))
	}
	cmu.Lock()
	c.Pid = pid
	c.State = "created"
	c.CreatedAt = time.Now().UnixNano()
	cmu.Unlock()
	go c.watch()
	return c.snapshot(), nil
}

// applySysctls sets the sysctls of a spec in the guest itself and drops them from the spec: the
// containers share the guest's network and IPC namespaces, which are the pod's.
func applySysctls(linux map[string]interface{}) error {
	sysctls, _ := linux["sysctl"].(map[string]interface{})
	for key, v := range sysctls {
		value, ok := v.(string)
		if !ok || strings.Contains(key, "..") || strings.ContainsAny(key, "/\x00") {
			return fmt.Errorf("create: bad sysctl %q", key)
		}
		path := "/proc/sys/" + strings.ReplaceAll(key, ".", "/")
		if err := os.WriteFile(path, []byte(value), 0); err != nil {
			return fmt.Errorf("create: sysctl %s=%s: %v", key, value, err)
		}
		delete(sysctls, key)
	}
	return nil
}

func readonlyRoot(spec map[string]interface{}) bool {
	if r, ok := spec["root"].(map[string]interface{}); ok {
		if ro, ok := r["readonly"].(bool); ok {
			return ro
		}
	}
	return false
}

// teeReader hands every read to tee as well (attached sessions see output as it comes, not a line later).
type teeReader struct {
	r   io.Reader
	tee func([]byte)
}

func (t teeReader) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	if n > 0 {
		t.tee(p[:n])
	}
	return n, err
}

// pump copies one output stream (a pipe, or a terminal's master) into the CRI log, cut into
// records as containerd cuts them (crilog.go). It blocks while the log buffer is full, and the
// container's writes then block on the full pipe or terminal; tee gets the output as it is read
// (attached sessions).
func pump(r *os.File, stream string, w *logBuffer, wg *sync.WaitGroup, tee func([]byte)) {
	defer wg.Done()
	defer w.writerDone()
	defer r.Close()
	liner := newLogLiner(maxLogLine)
	emit := func(partial bool, text []byte) { w.write(criRecord(time.Now(), stream, partial, text)) }
	src := teeReader{r, tee}
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			liner.feed(buf[:n], emit)
		}
		if err != nil {
			// EIO: the terminal's other side closed (every process holding it is gone)
			if err != io.EOF && !errors.Is(err, syscall.EIO) && !errors.Is(err, os.ErrClosed) {
				logf("log pump %s: %v", stream, err)
			}
			liner.end(emit)
			return
		}
	}
}

// watch waits for the container's init process (reparented to us, the subreaper) to exit.
func (c *container) watch() {
	var ws syscall.WaitStatus
	for {
		_, err := syscall.Wait4(c.Pid, &ws, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			logf("wait for container %s (pid %d): %v", c.ID, c.Pid, err)
		}
		break
	}
	untrack(c.Pid)
	finished := time.Now().UnixNano()
	oom := oomKills(c.cgroup) > 0
	// the output written before the exit reaches the log before the exit is reported
	logsDone := make(chan struct{})
	go func() { c.logs.Wait(); close(logsDone) }()
	select {
	case <-logsDone:
	case <-time.After(2 * time.Second):
	}
	cmu.Lock()
	c.State = "exited"
	c.FinishedAt = finished
	if ws.Exited() {
		c.ExitCode = ws.ExitStatus()
	} else if ws.Signaled() {
		c.Signal = int(ws.Signal())
		c.ExitCode = 128 + c.Signal
	}
	c.OOMKilled = oom
	cmu.Unlock()
	c.stdinMu.Lock()
	if c.stdin != nil && c.stdin != c.master { // a terminal's master is closed by its pump
		c.stdin.Close()
	}
	c.stdin = nil
	c.stdinMu.Unlock()
	close(c.done)
}

func oomKills(cgroup string) int {
	b, err := os.ReadFile(cgroupBase + cgroup + "/memory.events")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == "oom_kill" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

type idArgs struct {
	ID        string `json:"id"`
	Signal    string `json:"signal"`
	TimeoutMs int    `json:"timeout_ms"`
}

func parseID(raw json.RawMessage) (idArgs, *container, error) {
	var a idArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return a, nil, err
	}
	c, err := lookup(a.ID)
	return a, c, err
}

func opStart(raw json.RawMessage) (interface{}, error) {
	_, c, err := parseID(raw)
	if err != nil {
		return nil, err
	}
	if s := c.snapshot(); s.State != "created" {
		return nil, fmt.Errorf("start: container %s is %s, not created", c.ID, s.State)
	}
	if _, err := crun("start", c.ID); err != nil {
		return nil, err
	}
	cmu.Lock()
	if c.State == "created" {
		c.State = "running"
	}
	c.StartedAt = time.Now().UnixNano()
	cmu.Unlock()
	return c.snapshot(), nil
}

func opKill(raw json.RawMessage) (interface{}, error) {
	a, c, err := parseID(raw)
	if err != nil {
		return nil, err
	}
	sig := a.Signal
	if sig == "" {
		sig = "TERM"
	}
	if c.snapshot().State == "exited" {
		return c.snapshot(), nil
	}
	if out, err := crun("kill", c.ID, sig); err != nil {
		if c.snapshot().State == "exited" || strings.Contains(string(out), "not running") {
			return c.snapshot(), nil
		}
		return nil, err
	}
	return c.snapshot(), nil
}

// wait returns once the container exited or timeout_ms passed (status either way).
func opWait(raw json.RawMessage) (interface{}, error) {
	a, c, err := parseID(raw)
	if err != nil {
		return nil, err
	}
	select {
	case <-c.done:
	case <-time.After(time.Duration(a.TimeoutMs) * time.Millisecond):
	}
	return c.snapshot(), nil
}

func opStatus(raw json.RawMessage) (interface{}, error) {
	_, c, err := parseID(raw)
	if err != nil {
		return nil, err
	}
	return c.snapshot(), nil
}

// list: the containers whose create has answered (one still being created is its create's to report).
func opList(json.RawMessage) (interface{}, error) {
	cmu.Lock()
	all := make([]*container, 0, len(containers))
	for _, c := range containers {
		if c.State != "creating" {
			all = append(all, c)
		}
	}
	cmu.Unlock()
	out := make([]container, 0, len(all))
	for _, c := range all {
		out = append(out, c.snapshot())
	}
	return map[string]interface{}{"containers": out}, nil
}

func cleanup(id string) {
	dir := filepath.Join(stateDir, id)
	syscall.Unmount(filepath.Join(dir, "rootfs"), syscall.MNT_DETACH)
	syscall.Unmount(filepath.Join(dir, "lower"), syscall.MNT_DETACH) // a user namespace's idmapped lower
	os.RemoveAll(dir)
}

func opDelete(raw json.RawMessage) (interface{}, error) {
	_, c, err := parseID(raw)
	if err != nil {
		return nil, err
	}
	if c.snapshot().State != "exited" {
		crun("kill", c.ID, "KILL")
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			return nil, fmt.Errorf("delete: container %s did not die", c.ID)
		}
	}
	if _, err := crun("delete", "--force", c.ID); err != nil {
		logf("%v", err)
	}
	cleanup(c.ID)
	c.log.close()
	cmu.Lock()
	delete(containers, c.ID)
	cmu.Unlock()
	return nil, nil
}

func init() {
	handlers["create"] = opCreate
	handlers["start"] = opStart
	handlers["kill"] = opKill
	handlers["wait"] = opWait
	handlers["status"] = opStatus
	handlers["list"] = opList
	handlers["delete"] = opDelete
}
