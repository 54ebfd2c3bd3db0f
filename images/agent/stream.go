package main

// Streamed processes (the CRI's streaming Exec): a process started in a running container with
// pipes or a terminal, whose output the host takes in bounded chunks (proc_read, a long poll),
// whose stdin the host writes in bounded pieces, and whose exit code the host collects. Output is
// read from the process only while less than procBufMax bytes per stream wait for the host, so a
// host that stops reading stops the process at its next write (back-pressure, bounded memory).
// A process whose host goes away (proc_release, the channel closing, or no request for
// procLease) gets SIGHUP (its terminal closes) or EOF on stdin and closed output pipes, then
// SIGKILL after procKillGrace, and is reaped.

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

const (
	procBufMax     = 256 << 10 // bytes of output per stream waiting for the host
	procReadChunk  = 32 << 10
	procWriteMax   = 32 << 10 // bytes of stdin one proc_write may carry (its line stays under 64 KiB)
	procMaxLive    = 64       // streamed processes at once in this guest
	procLease      = 10 * time.Minute
	procKillGrace  = 2 * time.Second
	procDrainGrace = 2 * time.Second // after the exit, how long output may still arrive
	procMaxPollMs  = 30000
)

type procStream struct {
	buf []byte
	eof bool
}

type proc struct {
	id      string
	cid     string
	tty     bool
	mu      sync.Mutex
	cond    *sync.Cond
	out     [2]procStream // stdout, stderr (a terminal has stdout only)
	stdin   *os.File      // pipe write end, or the terminal's master; nil when closed or not asked
	master  *os.File      // the terminal's master (tty only)
	outR    [2]*os.File   // our read ends of the output pipes (pipes only)
	exited  bool
	exitAt  time.Time
	code    int
	pidFile string
	cmd     *exec.Cmd
	seen    time.Time
	wmu     sync.Mutex // one stdin write at a time
	release sync.Once
}

var procs struct {
	sync.Mutex
	m map[string]*proc
	n int
}

func lookupProc(raw json.RawMessage) (*proc, error) {
	var a struct {
		Proc string `json:"proc"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	procs.Lock()
	defer procs.Unlock()
	p, ok := procs.m[a.Proc]
	if !ok {
		return nil, fmt.Errorf("no streamed process %q (it ended, or was released)", a.Proc)
	}
	p.mu.Lock()
	p.seen = time.Now()
	p.mu.Unlock()
	return p, nil
}

type procStartArgs struct {
	ID    string   `json:"id"`
	Argv  []string `json:"argv"`
	TTY   bool     `json:"tty"`
	Stdin bool     `json:"stdin"`
	Rows  int      `json:"rows"`
	Cols  int      `json:"cols"`
}

// receiveMaster accepts crun's connection on the console socket and takes the terminal's
// master descriptor it sends (SCM_RIGHTS).
func receiveMaster(l *net.UnixListener) (*os.File, error) {
	l.SetDeadline(time.Now().Add(30 * time.Second))
	conn, err := l.AcceptUnix()
	if err != nil {
		return nil, fmt.Errorf("console socket: %v", err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	buf := make([]byte, 4096)
	oob := make([]byte, syscall.CmsgSpace(4*4))
	_, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("console socket: %v", err)
	}
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, fmt.Errorf("console socket: %v", err)
	}
	for _, m := range msgs {
		fds, err := syscall.ParseUnixRights(&m)
		if err != nil || len(fds) == 0 {
			continue
		}
		for _, extra := range fds[1:] {
			syscall.Close(extra)
		}
		syscall.SetNonblock(fds[0], true) // pollable: writes and reads honour deadlines
		return os.NewFile(uintptr(fds[0]), "pty-master"), nil
	}
	return nil, fmt.Errorf("console socket: no descriptor received")
}

func opProcStart(raw json.RawMessage) (interface{}, error) {
	var a procStartArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("proc_start: %v", err)
	}
	c, err := lookup(a.ID)
	if err != nil {
		return nil, err
	}
	if len(a.Argv) == 0 {
		return nil, fmt.Errorf("proc_start: empty command")
	}
	if s := c.snapshot(); s.State != "running" {
		return nil, fmt.Errorf("proc_start: container %s is %s, not running", c.ID, s.State)
	}
	procs.Lock()
	if len(procs.m) >= procMaxLive {
		procs.Unlock()
		return nil, fmt.Errorf("proc_start: %d streamed processes already run in this guest", procMaxLive)
	}
	procs.n++
	n := procs.n
	procs.Unlock()

	spec := map[string]interface{}{}
	if ps, ok := c.spec["process"].(map[string]interface{}); ok {
		for k, v := range ps {
			spec[k] = v
		}
	}
	spec["args"] = a.Argv
	spec["terminal"] = a.TTY
	delete(spec, "consoleSize")
	if a.TTY && a.Rows > 0 && a.Cols > 0 {
		spec["consoleSize"] = map[string]int{"height": a.Rows, "width": a.Cols}
	}
	b, _ := json.Marshal(spec)
	dir := filepath.Join(stateDir, c.ID)
	procFile := filepath.Join(dir, fmt.Sprintf("proc-%d.json", n))
	p := &proc{id: strconv.Itoa(n), cid: c.ID, tty: a.TTY, seen: time.Now(),
		pidFile: filepath.Join(dir, fmt.Sprintf("proc-%d.pid", n))}
	p.cond = sync.NewCond(&p.mu)
	if err := os.WriteFile(procFile, b, 0o600); err != nil {
		return nil, err
	}
	args := []string{"--root", crunRoot, "exec", "--process", procFile, "--pid-file", p.pidFile}
	cmd := exec.Command("/usr/bin/crun")
	var closeAfterStart []*os.File
	var listener *net.UnixListener
	if a.TTY {
		sock := filepath.Join(dir, fmt.Sprintf("proc-%d.sock", n))
		os.Remove(sock)
		listener, err = net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			return nil, fmt.Errorf("proc_start: console socket: %v", err)
		}
		defer listener.Close()
		defer os.Remove(sock)
		args = append(args, "--console-socket", sock)
	} else {
		names := [2]string{"stdout", "stderr"}
		for i := range names {
			r, w, err := os.Pipe()
			if err != nil {
				return nil, err
			}
			p.outR[i] = r
			closeAfterStart = append(closeAfterStart, w)
			if i == 0 {
				cmd.Stdout = w
			} else {
				cmd.Stderr = w
			}
		}
		if a.Stdin {
			r, w, err := os.Pipe()
			if err != nil {
				return nil, err
			}
			cmd.Stdin = r
			p.stdin = w
			closeAfterStart = append(closeAfterStart, r)
		}
	}
	cmd.Args = append([]string{"/usr/bin/crun"}, append(args, c.ID)...)
	p.cmd = cmd
	if err := startTracked(cmd); err != nil {
		for _, f := range closeAfterStart {
			f.Close()
		}
		os.Remove(procFile)
		p.closeAll()
		return nil, fmt.Errorf("proc_start: %v", err)
	}
	for _, f := range closeAfterStart {
		f.Close()
	}
	exited := make(chan struct{})
	go func() {
		err := waitTracked(cmd)
		os.Remove(procFile) // crun reads it while it starts the process: only now is it unused
		code := 0
		if err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				ws := ee.Sys().(syscall.WaitStatus)
				if ws.Signaled() {
					code = 128 + int(ws.Signal())
				} else {
					code = ws.ExitStatus()
				}
			} else {
				code = 255
			}
		}
		p.mu.Lock()
		p.exited, p.code, p.exitAt = true, code, time.Now()
		p.cond.Broadcast()
		p.mu.Unlock()
		close(exited)
		// wake pollers once the drain grace has passed
		time.AfterFunc(procDrainGrace, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	}()
	if a.TTY {
		type got struct {
			f   *os.File
			err error
		}
		ch := make(chan got, 1)
		go func() { f, err := receiveMaster(listener); ch <- got{f, err} }()
		var g got
		select {
		case g = <-ch:
		case <-exited:
			listener.Close()
			g = <-ch
		}
		if g.err != nil {
			p.kill()
			return nil, fmt.Errorf("proc_start: %v", g.err)
		}
		p.master = g.f
		if a.Stdin {
			p.stdin = g.f
		}
		p.out[1].eof = true
		go p.pump(0, g.f)
	} else {
		go p.pump(0, p.outR[0])
		go p.pump(1, p.outR[1])
	}
	procs.Lock()
	if procs.m == nil {
		procs.m = map[string]*proc{}
	}
	procs.m[p.id] = p
	procs.Unlock()
	return map[string]interface{}{"proc": p.id}, nil
}

// pump moves output of stream i into its buffer while the buffer has room.
func (p *proc) pump(i int, r *os.File) {
	tmp := make([]byte, procReadChunk)
	for {
		p.mu.Lock()
		for len(p.out[i].buf) >= procBufMax && !p.out[i].eof {
			p.cond.Wait()
		}
		done := p.out[i].eof
		p.mu.Unlock()
		if done {
			return
		}
		n, err := r.Read(tmp)
		p.mu.Lock()
		if n > 0 {
			p.out[i].buf = append(p.out[i].buf, tmp[:n]...)
		}
		if err != nil {
			p.out[i].eof = true // EOF, or EIO from a terminal whose other side closed
		}
		p.cond.Broadcast()
		p.mu.Unlock()
	}
}

// finished: exited and the output drained (every stream at EOF, or the drain grace passed).
func (p *proc) finishedLocked() bool {
	if !p.exited || len(p.out[0].buf) > 0 || len(p.out[1].buf) > 0 {
		return false
	}
	return (p.out[0].eof && p.out[1].eof) || time.Since(p.exitAt) >= procDrainGrace
}

func take(s *procStream, max int) []byte {
	n := len(s.buf)
	if n > max {
		n = max
	}
	out := make([]byte, n)
	copy(out, s.buf[:n])
	s.buf = s.buf[n:]
	if len(s.buf) == 0 {
		s.buf = nil
	}
	return out
}

// proc_read: {"proc","max_bytes","timeout_ms"} -> {"stdout","stderr" (base64),"done","exit_code"}
// Returns once output is there, the process finished, or the timeout passed.
func opProcRead(raw json.RawMessage) (interface{}, error) {
	p, err := lookupProc(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		MaxBytes  int `json:"max_bytes"`
		TimeoutMs int `json:"timeout_ms"`
	}
	json.Unmarshal(raw, &a)
	if a.MaxBytes <= 0 || a.MaxBytes > procBufMax {
		a.MaxBytes = procBufMax
	}
	if a.TimeoutMs < 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = procMaxPollMs
	}
	deadline := time.Now().Add(time.Duration(a.TimeoutMs) * time.Millisecond)
	t := time.AfterFunc(time.Duration(a.TimeoutMs)*time.Millisecond, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer t.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.out[0].buf) == 0 && len(p.out[1].buf) == 0 && !p.finishedLocked() && time.Now().Before(deadline) {
		p.cond.Wait()
	}
	stdout := take(&p.out[0], a.MaxBytes)
	stderr := take(&p.out[1], a.MaxBytes-len(stdout))
	p.cond.Broadcast() // room again for the pumps
	body := map[string]interface{}{"stdout": stdout, "stderr": stderr, "done": p.finishedLocked()}
	if p.finishedLocked() {
		body["exit_code"] = p.code
	}
	return body, nil
}

// proc_write: {"proc","data" (base64, at most procWriteMax),"timeout_ms"} -> {"written"}
func opProcWrite(raw json.RawMessage) (interface{}, error) {
	p, err := lookupProc(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		Data      []byte `json:"data"`
		TimeoutMs int    `json:"timeout_ms"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("proc_write: %v", err)
	}
	if len(a.Data) > procWriteMax {
		return nil, fmt.Errorf("proc_write: %d bytes at once (at most %d)", len(a.Data), procWriteMax)
	}
	if a.TimeoutMs <= 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = 10000
	}
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.mu.Lock()
	w := p.stdin
	p.mu.Unlock()
	if w == nil {
		return nil, fmt.Errorf("proc_write: the process has no open stdin")
	}
	w.SetWriteDeadline(time.Now().Add(time.Duration(a.TimeoutMs) * time.Millisecond))
	n, err := w.Write(a.Data)
	if err != nil && !os.IsTimeout(err) {
		return map[string]interface{}{"written": n, "closed": true}, nil
	}
	return map[string]interface{}{"written": n}, nil
}

// proc_close_stdin: {"proc"} -> {}. A terminal gets ^D (its EOF) instead, as it stays open for output.
func opProcCloseStdin(raw json.RawMessage) (interface{}, error) {
	p, err := lookupProc(raw)
	if err != nil {
		return nil, err
	}
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.mu.Lock()
	w := p.stdin
	p.stdin = nil
	p.mu.Unlock()
	if w == nil {
		return nil, nil
	}
	if p.tty {
		w.SetWriteDeadline(time.Now().Add(time.Second))
		w.Write([]byte{4})
		return nil, nil
	}
	w.Close()
	return nil, nil
}

type winsize struct{ Row, Col, X, Y uint16 }

// proc_resize: {"proc","rows","cols"} -> {}; a process without a terminal is refused.
func opProcResize(raw json.RawMessage) (interface{}, error) {
	p, err := lookupProc(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		Rows int `json:"rows"`
		Cols int `json:"cols"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("proc_resize: %v", err)
	}
	if !p.tty || p.master == nil {
		return nil, fmt.Errorf("proc_resize: the process has no terminal")
	}
	if err := setWinsize(p.master, a.Rows, a.Cols); err != nil {
		return nil, fmt.Errorf("proc_resize: %v", err)
	}
	return nil, nil
}

// setWinsize sets the size of the terminal whose master is f (TIOCSWINSZ: the kernel sends
// SIGWINCH to the terminal's foreground process group when the size changes).
func setWinsize(f *os.File, rows, cols int) error {
	if rows <= 0 || cols <= 0 || rows > 65535 || cols > 65535 {
		return fmt.Errorf("bad size %dx%d", cols, rows)
	}
	ws := winsize{Row: uint16(rows), Col: uint16(cols)}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno syscall.Errno
	if err := rc.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCSWINSZ, uintptr(unsafe.Pointer(&ws)))
	}); err != nil {
		return err
	}
	if errno != 0 {
		return errno
	}
	return nil
}

// proc_wait: {"proc","timeout_ms"} -> {"exited","exit_code"}
func opProcWait(raw json.RawMessage) (interface{}, error) {
	p, err := lookupProc(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		TimeoutMs int `json:"timeout_ms"`
	}
	json.Unmarshal(raw, &a)
	if a.TimeoutMs < 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = procMaxPollMs
	}
	deadline := time.Now().Add(time.Duration(a.TimeoutMs) * time.Millisecond)
	t := time.AfterFunc(time.Duration(a.TimeoutMs)*time.Millisecond, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer t.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.exited && time.Now().Before(deadline) {
		p.cond.Wait()
	}
	return map[string]interface{}{"exited": p.exited, "exit_code": p.code}, nil
}

// proc_release: {"proc"} -> {}. The host is done with the process (or went away).
func opProcRelease(raw json.RawMessage) (interface{}, error) {
	p, err := lookupProc(raw)
	if err != nil {
		return nil, nil // already gone: releasing is idempotent
	}
	p.kill()
	return nil, nil
}

func (p *proc) closeAll() {
	p.mu.Lock()
	files := []*os.File{p.stdin, p.master, p.outR[0], p.outR[1]}
	p.stdin, p.master = nil, nil
	p.out[0].eof, p.out[1].eof = true, true
	p.out[0].buf, p.out[1].buf = nil, nil
	p.cond.Broadcast()
	p.mu.Unlock()
	seen := map[*os.File]bool{}
	for _, f := range files {
		if f != nil && !seen[f] {
			seen[f] = true
			f.Close()
		}
	}
}

// kill: SIGHUP / EOF now (descriptors closed), SIGKILL after the grace, then forgotten.
func (p *proc) kill() {
	p.release.Do(func() {
		p.closeAll()
		go func() {
			deadline := time.Now().Add(procKillGrace)
			for time.Now().Before(deadline) {
				p.mu.Lock()
				ex := p.exited
				p.mu.Unlock()
				if ex {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			p.mu.Lock()
			ex := p.exited
			p.mu.Unlock()
			if !ex {
				if t, err := os.ReadFile(p.pidFile); err == nil {
					if pid, err := strconv.Atoi(strings.TrimSpace(string(t))); err == nil && pid > 0 {
						syscall.Kill(pid, syscall.SIGKILL)
					}
				}
				if p.cmd != nil && p.cmd.Process != nil {
					p.cmd.Process.Kill()
				}
			}
			os.Remove(p.pidFile)
			procs.Lock()
			delete(procs.m, p.id)
			procs.Unlock()
		}()
	})
}

func init() {
	handlers["proc_start"] = opProcStart
	handlers["proc_read"] = opProcRead
	handlers["proc_write"] = opProcWrite
	handlers["proc_close_stdin"] = opProcCloseStdin
	handlers["proc_resize"] = opProcResize
	handlers["proc_wait"] = opProcWait
	handlers["proc_release"] = opProcRelease
	go janitor(idleProcs)
}
