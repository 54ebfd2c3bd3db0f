package main

// exec (run a process in a running container, output captured and bounded), stats (from the
// container's cgroup) and update (cgroup limits of a running container).

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// boundedBuffer keeps the first max bytes written and counts the rest.
type boundedBuffer struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	max     int
	dropped int64
}

func (b *boundedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	room := b.max - b.buf.Len()
	if room > len(p) {
		room = len(p)
	}
	if room > 0 {
		b.buf.Write(p[:room])
	}
	b.dropped += int64(len(p) - room)
	return len(p), nil
}

type execArgs struct {
	ID        string   `json:"id"`
	Argv      []string `json:"argv"`
	TimeoutMs int      `json:"timeout_ms"`
	MaxBytes  int      `json:"max_bytes"`
}

var execSeq struct {
	sync.Mutex
	n int
}

func opExec(raw json.RawMessage) (interface{}, error) {
	var a execArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("exec: %v", err)
	}
	c, err := lookup(a.ID)
	if err != nil {
		return nil, err
	}
	if len(a.Argv) == 0 {
		return nil, fmt.Errorf("exec: empty command")
	}
	if s := c.snapshot(); s.State != "running" {
		return nil, fmt.Errorf("exec: container %s is %s, not running", c.ID, s.State)
	}
	if a.MaxBytes <= 0 {
		a.MaxBytes = 16 << 20
	}
	// the process runs as the container's own (user, env, cwd, capabilities), with new args
	proc := map[string]interface{}{}
	if p, ok := c.spec["process"].(map[string]interface{}); ok {
		for k, v := range p {
			proc[k] = v
		}
	}
	proc["args"] = a.Argv
	proc["terminal"] = false
	b, _ := json.Marshal(proc)
	execSeq.Lock()
	execSeq.n++
	n := execSeq.n
	execSeq.Unlock()
	dir := filepath.Join(stateDir, c.ID)
	procFile := filepath.Join(dir, fmt.Sprintf("exec-%d.json", n))
	pidFile := filepath.Join(dir, fmt.Sprintf("exec-%d.pid", n))
	defer os.Remove(procFile)
	defer os.Remove(pidFile)
	if err := os.WriteFile(procFile, b, 0o600); err != nil {
		return nil, err
	}
	stdout := &boundedBuffer{max: a.MaxBytes}
	stderr := &boundedBuffer{max: a.MaxBytes}
	cmd := exec.Command("/usr/bin/crun", "--root", crunRoot, "exec", "--process", procFile,
		"--pid-file", pidFile, c.ID)
	cmd.Stdout = stdout
	cmd.Stderr = stderr
	start := time.Now()
	if err := startTracked(cmd); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- waitTracked(cmd) }()
	timedOut := false
	var timeout <-chan time.Time
	if a.TimeoutMs > 0 {
		timeout = time.After(time.Duration(a.TimeoutMs) * time.Millisecond)
	}
	var werr error
	select {
	case werr = <-done:
	case <-timeout:
		timedOut = true
		werr = stopTimedOut(cmd, pidFile, done, execPidWait)
	}
	code := 0
	if werr != nil {
		if ee, ok := werr.(*exec.ExitError); ok {
			ws := ee.Sys().(syscall.WaitStatus)
			if ws.Signaled() {
				code = 128 + int(ws.Signal())
			} else {
				code = ws.ExitStatus()
			}
		} else {
			return nil, fmt.Errorf("exec: %v", werr)
		}
	}
	return &execBody{
		fields: map[string]interface{}{
			"exit_code":     code,
			"timed_out":     timedOut,
			"dropped_bytes": stdout.dropped + stderr.dropped,
			"duration_ns":   time.Since(start).Nanoseconds(),
		},
		stdout: stdout.buf.Bytes(),
		stderr: stderr.buf.Bytes(),
	}, nil
}

// execPidWait is how long an exec whose timeout passed waits for crun to name the process it started.
const execPidWait = 3 * time.Second

// stopTimedOut ends an exec whose timeout passed: first the process crun started (the pid crun
// wrote to pidFile), then crun (cmd); it answers crun's Wait (from done). crun writes the pid file
// once the process runs, which in a loaded emulated guest can be after the timeout; killing crun
// before then left the process running, holding the output pipes (and so the exec's answer) open
// until it ended by itself. So the pid file is waited for, up to wait, while crun runs.
func stopTimedOut(cmd *exec.Cmd, pidFile string, done <-chan error, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		if t, err := os.ReadFile(pidFile); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(t))); err == nil && pid > 0 {
				syscall.Kill(pid, syscall.SIGKILL)
				break
			}
		}
		if time.Now().After(deadline) {
			break
		}
		select {
		case err := <-done: // crun ended meanwhile, and its process with it
			return err
		case <-time.After(10 * time.Millisecond):
		}
	}
	cmd.Process.Kill()
	return <-done
}

// execBody is the body of an exec response, written to the channel as it is encoded: its
// output (up to max_bytes per stream) goes out as base64 through a small buffer, where building
// the whole line first would take several copies of it (a guest of 128 MiB could not hold the
// copies of a few MiB of output, and the kernel killed the agent).
type execBody struct {
	fields         map[string]interface{}
	stdout, stderr []byte
}

// writeTo writes the body's JSON object to w: the small fields, then "stdout" and "stderr".
func (e *execBody) writeTo(w *bufio.Writer) error {
	head, err := json.Marshal(e.fields)
	if err != nil {
		return err
	}
	w.Write(head[:len(head)-1]) // without its closing brace
	for _, s := range []struct {
		key  string
		data []byte
	}{{"stdout", e.stdout}, {"stderr", e.stderr}} {
		fmt.Fprintf(w, `,%q:"`, s.key)
		enc := base64.NewEncoder(base64.StdEncoding, w)
		enc.Write(s.data)
		enc.Close()
		w.WriteByte('"')
	}
	w.WriteByte('}')
	return w.Flush()
}

func readKV(path string) map[string]int64 {
	out := map[string]int64{}
	b, err := os.ReadFile(path)
	if err != nil {
		return out
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 {
			if v, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				out[f[0]] = v
			}
		}
	}
	return out
}

func readInt(path string) int64 {
	v, _ := strconv.ParseInt(strings.TrimSpace(firstLine(path)), 10, 64)
	return v
}

func dirBytes(root string) (int64, int64) {
	var size, inodes int64
	filepath.Walk(root, func(_ string, info os.FileInfo, err error) error {
		if err != nil {
			return nil
		}
		inodes++
		if info.Mode().IsRegular() {
			size += info.Size()
		}
		return nil
	})
	return size, inodes
}

func cgroupStats(cg string) map[string]interface{} {
	dir := cgroupBase + cg
	cpu := readKV(dir + "/cpu.stat")
	mem := readKV(dir + "/memory.stat")
	current := readInt(dir + "/memory.current")
	ws := current - mem["inactive_file"]
	if ws < 0 {
		ws = 0
	}
	return map[string]interface{}{
		"timestamp_ns":        time.Now().UnixNano(),
		"cpu_usage_ns":        cpu["usage_usec"] * 1000,
		"memory_usage_bytes":  current,
		"memory_working_set":  ws,
		"memory_rss_bytes":    mem["anon"],
		"memory_page_faults":  mem["pgfault"],
		"memory_major_faults": mem["pgmajfault"],
		"pids":                readInt(dir + "/pids.current"),
		"oom_kills":           int64(oomKills(cg)),
	}
}

func opStats(raw json.RawMessage) (interface{}, error) {
	var a idArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	if a.ID == "" {
		// the whole guest: its root cgroup
		s := cgroupStats("")
		s["memory_usage_bytes"] = memUsedBytes()
		s["memory_working_set"] = memUsedBytes()
		s["agent_rss_bytes"] = selfRSSBytes()
		return s, nil
	}
	c, err := lookup(a.ID)
	if err != nil {
		return nil, err
	}
	s := cgroupStats(c.cgroup)
	upper := filepath.Join(stateDir, c.ID, "upper")
	used, inodes := dirBytes(upper)
	s["writable_bytes"] = used
	s["writable_inodes"] = inodes
	cgroupMetrics(cgroupBase+c.cgroup, s)
	writableFS(upper, s)
	return s, nil
}

// selfRSSBytes is the agent's own resident memory (VmRSS of /proc/self/status).
func selfRSSBytes() int64 {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			return v * 1024
		}
	}
	return 0
}

// memUsedBytes is the guest's memory in use: MemTotal - MemAvailable (/proc/meminfo, in kB).
func memUsedBytes() int64 {
	b, _ := os.ReadFile("/proc/meminfo")
	m := map[string]int64{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			m[strings.TrimSuffix(f[0], ":")] = v
		}
	}
	return (m["MemTotal"] - m["MemAvailable"]) * 1024
}

var cgroupFiles = map[string]bool{
	"memory.max": true, "memory.high": true, "memory.swap.max": true, "cpu.max": true,
	"cpu.weight": true, "pids.max": true, "cpuset.cpus": true, "cpuset.mems": true,
}

// update writes cgroup limits of a container: {"id":..., "files": {"memory.max": "268435456"}}.
func opUpdate(raw json.RawMessage) (interface{}, error) {
	var a struct {
		ID    string            `json:"id"`
		Files map[string]string `json:"files"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	c, err := lookup(a.ID)
	if err != nil {
		return nil, err
	}
	for name, value := range a.Files {
		if !cgroupFiles[name] && !strings.HasPrefix(name, "hugetlb.") {
			return nil, fmt.Errorf("update: %q is not a cgroup limit this agent writes", name)
		}
		if strings.ContainsAny(name, "/\x00") || strings.ContainsAny(value, "\n\x00") {
			return nil, fmt.Errorf("update: bad value for %s", name)
		}
		if err := os.WriteFile(cgroupBase+c.cgroup+"/"+name, []byte(value), 0); err != nil {
			return nil, fmt.Errorf("update: %s: %v", name, err)
		}
	}
	return nil, nil
}

func init() {
	handlers["exec"] = opExec
	handlers["stats"] = opStats
	handlers["update"] = opUpdate
}
