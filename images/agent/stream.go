package main

// Streamed processes (the CRI's streaming Exec): a process started in a running container with
// pipes or a terminal, as a stream session (session.go): the host takes its output in bounded
// chunks (proc_read, a long poll), writes its stdin in bounded pieces, and learns its exit code
// once it finished. Output is read from the process only while less than sessionBufMax bytes per
// stream wait for the host, so a host that stops reading stops the process at its next write.
// A process whose host goes away (proc_release, the channel closing, or no request for
// sessionLease) gets SIGHUP (its terminal closes) or EOF on stdin and closed output pipes, then
// SIGKILL after procKillGrace, and is reaped; its id is known until then.

import (
	"encoding/json"
	"errors"
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
	procMaxLive    = 64 // streamed processes at once in this guest
	procKillGrace  = 2 * time.Second
	procDrainGrace = 2 * time.Second // after the exit, how long output may still arrive
)

var procs = &sessions{
	idField: "proc",
	max:     procMaxLive,
	unknown: func(id string) error { return fmt.Errorf("no streamed process %q (it ended, or was released)", id) },
	full: func(int) error {
		return fmt.Errorf("proc_start: %d streamed processes already run in this guest", procMaxLive)
	},
	answer: procAnswer,
}

func init() {
	handlers["proc_start"] = opProcStart
	handlers["proc_wait"] = opProcWait
	procs.register(sessionOps{read: "proc_read", write: "proc_write", closeInput: "proc_close_stdin",
		resize: "proc_resize", release: "proc_release"})
}

// procAnswer is proc_read's answer: {"stdout","stderr" (base64),"done","exit_code" (once done)}.
func procAnswer(r readResult) map[string]interface{} {
	body := map[string]interface{}{"stdout": r.out[0], "stderr": r.out[1], "done": r.done}
	if r.done {
		body["exit_code"] = r.code
	}
	return body
}

// procSource is a streamed process: crun exec's child, with its pipes or its terminal's master.
type procSource struct {
	tty     bool
	pidFile string
	cmd     *exec.Cmd
	mu      sync.Mutex
	stdin   *os.File    // pipe write end, or the terminal's master; nil when closed or not asked
	master  *os.File    // the terminal's master (tty only)
	outR    [2]*os.File // our read ends of the output pipes (pipes only)
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

// proc_start: {"id","argv","tty","stdin","rows","cols"} -> {"proc"}
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
	id, err := procs.reserve()
	if err != nil {
		return nil, err
	}
	s, err := startProc(c, a, id)
	if err != nil {
		procs.unreserve()
		return nil, err
	}
	procs.add(id, s)
	return map[string]interface{}{"proc": id}, nil
}

// startProc runs `crun exec` of a.Argv in c with the container's process settings, its output
// pumped into a new session.
func startProc(c *container, a procStartArgs, id string) (*session, error) {
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
	procFile := filepath.Join(dir, "proc-"+id+".json")
	p := &procSource{tty: a.TTY, pidFile: filepath.Join(dir, "proc-"+id+".pid")}
	s := newSession(2, procDrainGrace, p)
	if err := os.WriteFile(procFile, b, 0o600); err != nil {
		return nil, err
	}
	args := []string{"--root", crunRoot, "exec", "--process", procFile, "--pid-file", p.pidFile}
	cmd := exec.Command("/usr/bin/crun")
	var closeAfterStart []*os.File
	var listener *net.UnixListener
	if a.TTY {
		sock := filepath.Join(dir, "proc-"+id+".sock")
		os.Remove(sock)
		var err error
		listener, err = net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			return nil, fmt.Errorf("proc_start: console socket: %v", err)
		}
		defer listener.Close()
		defer os.Remove(sock)
		args = append(args, "--console-socket", sock)
	} else {
		for i := range p.outR {
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
	err := startTracked(cmd)
	for _, f := range closeAfterStart {
		f.Close()
	}
	if err != nil {
		os.Remove(procFile)
		p.closeFiles()
		return nil, fmt.Errorf("proc_start: %v", err)
	}
	go func() {
		err := waitTracked(cmd)
		os.Remove(procFile) // crun reads it while it starts the process: only now is it unused
		s.end(exitCode(err))
	}()
	if !a.TTY {
		go s.pump(0, p.outR[0])
		go s.pump(1, p.outR[1])
		return s, nil
	}
	type got struct {
		f   *os.File
		err error
	}
	ch := make(chan got, 1)
	go func() { f, err := receiveMaster(listener); ch <- got{f, err} }()
	var g got
	select {
	case g = <-ch:
	case <-s.ends():
		listener.Close()
		g = <-ch
	}
	if g.err != nil {
		s.close()
		return nil, fmt.Errorf("proc_start: %v", g.err)
	}
	p.mu.Lock()
	p.master = g.f
	if a.Stdin {
		p.stdin = g.f
	}
	p.mu.Unlock()
	s.shut(1) // a terminal has one output stream
	go s.pump(0, g.f)
	return s, nil
}

// exitCode is a waited process's exit code: 128+N when signal N killed it, 255 when the wait failed.
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return 255
	}
	ws := ee.Sys().(syscall.WaitStatus)
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

func (p *procSource) write(data []byte, deadline time.Time) (int, bool, error) {
	p.mu.Lock()
	w := p.stdin
	p.mu.Unlock()
	if w == nil {
		return 0, false, errors.New("the process has no open stdin")
	}
	w.SetWriteDeadline(deadline)
	n, err := w.Write(data)
	if err != nil && !os.IsTimeout(err) {
		return n, true, nil
	}
	return n, false, nil
}

// closeInput closes the stdin pipe; a terminal gets ^D (its EOF) instead, as it stays open for output.
func (p *procSource) closeInput() {
	p.mu.Lock()
	w := p.stdin
	p.stdin = nil
	p.mu.Unlock()
	if w == nil {
		return
	}
	if p.tty {
		w.SetWriteDeadline(time.Now().Add(time.Second))
		w.Write([]byte{4})
		return
	}
	w.Close()
}

func (p *procSource) resize(rows, cols int) error {
	p.mu.Lock()
	master := p.master
	p.mu.Unlock()
	if !p.tty || master == nil {
		return errors.New("the process has no terminal")
	}
	return setWinsize(master, rows, cols)
}

// closeFiles closes the process's terminal or pipes: SIGHUP, or EOF on its stdin and SIGPIPE on output.
func (p *procSource) closeFiles() {
	p.mu.Lock()
	files := []*os.File{p.stdin, p.master, p.outR[0], p.outR[1]}
	p.stdin, p.master, p.outR = nil, nil, [2]*os.File{}
	p.mu.Unlock()
	seen := map[*os.File]bool{}
	for _, f := range files {
		if f != nil && !seen[f] {
			seen[f] = true
			f.Close()
		}
	}
}

// release: SIGHUP / EOF now (descriptors closed), SIGKILL after the grace, then forgotten.
func (p *procSource) release(s *session) {
	p.closeFiles()
	go func() {
		grace := time.NewTimer(procKillGrace)
		defer grace.Stop()
		select {
		case <-s.ends():
		case <-grace.C:
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
		s.forget()
	}()
}

// proc_wait: {"proc","timeout_ms"} -> {"exited","exit_code"}
func opProcWait(raw json.RawMessage) (interface{}, error) {
	s, err := procs.lookup(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		TimeoutMs int `json:"timeout_ms"`
	}
	json.Unmarshal(raw, &a)
	exited, code := s.waitEnd(clampPoll(a.TimeoutMs))
	return map[string]interface{}{"exited": exited, "exit_code": code}, nil
}

type winsize struct{ Row, Col, X, Y uint16 }

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
