package main

// Attach (the CRI's streaming Attach): stream sessions (session.go) on a running container's own
// stdio. The container's output reaches its CRI log as always and, as the log pump reads it, every
// attached session; a session that the host does not read keeps at most sessionBufMax bytes per
// stream and counts the rest as dropped, so an attached client can never stall the container or
// its log. A session ends when its container exits and the host took its output. A
// container created with `stdin` has a pipe for stdin the sessions write to; with `stdin_once`
// the pipe is closed when the first session that wrote to it ends (as containerd does).
//
// A container created with `tty` has a terminal: its output (one stream) goes to the sessions as
// stdout, their stdin is written to the terminal's master, and attach_resize sets the terminal's
// size (the kernel sends the container's foreground process group SIGWINCH). Every session of the
// container shares the one terminal. With `stdin_once`, the end of the first session's stdin is
// the terminal's end-of-file character (^D; twice when the last line was not ended, the first one
// ending that line), so the process reads end-of-file while its output still reaches the log.

import (
	"encoding/json"
	"fmt"
	"os"
	"time"
)

var attaches = &sessions{
	idField: "attach",
	max:     procMaxLive,
	unknown: func(id string) error { return fmt.Errorf("no attach session %q", id) },
	full:    func(int) error { return fmt.Errorf("attach: %d sessions already in this guest", procMaxLive) },
	answer:  attachAnswer,
}

func init() {
	handlers["attach_open"] = opAttachOpen
	attaches.register(sessionOps{read: "attach_read", write: "attach_write", closeInput: "attach_close_stdin",
		resize: "attach_resize", release: "attach_release"})
}

// attachAnswer is attach_read's answer: {"stdout","stderr" (base64),"done" (the container exited
// and all was read),"dropped_bytes"}.
func attachAnswer(r readResult) map[string]interface{} {
	return map[string]interface{}{"stdout": r.out[0], "stderr": r.out[1], "done": r.done,
		"dropped_bytes": r.dropped}
}

// attachSource is a session's view of its container: the container's stdin, shared by its sessions.
type attachSource struct{ c *container }

// attachTee hands a piece of the container's output (stream 0 stdout, 1 stderr) to its sessions.
func attachTee(c *container, stream int) func([]byte) {
	return func(b []byte) {
		attaches.each(func(s *session) {
			if src, ok := s.src.(attachSource); ok && src.c == c {
				s.offer(stream, b)
			}
		})
	}
}

// attach_open: {"id"} -> {"attach"}
func opAttachOpen(raw json.RawMessage) (interface{}, error) {
	_, c, err := parseID(raw)
	if err != nil {
		return nil, err
	}
	if s := c.snapshot(); s.State != "running" {
		return nil, fmt.Errorf("attach: container %s is %s, not running", c.ID, s.State)
	}
	id, err := attaches.reserve()
	if err != nil {
		return nil, err
	}
	s := newSession(2, 0, attachSource{c})
	attaches.add(id, s)
	go func() { // the session ends with its container
		select {
		case <-c.done:
			s.end(0)
		case <-s.gone:
		}
	}()
	return map[string]interface{}{"attach": id}, nil
}

func (a attachSource) write(data []byte, deadline time.Time) (int, bool, error) {
	c := a.c
	c.stdinMu.Lock()
	defer c.stdinMu.Unlock()
	if c.stdin == nil {
		return 0, true, nil
	}
	c.stdinUsed = true
	c.stdin.SetWriteDeadline(deadline)
	n, err := c.stdin.Write(data)
	if n > 0 {
		c.stdinNL = data[n-1] == '\n' || data[n-1] == '\r'
	}
	if err != nil && !os.IsTimeout(err) {
		return n, true, nil
	}
	return n, false, nil
}

// closeInput: the client closed its stdin.
func (a attachSource) closeInput() { a.c.closeStdinOnce() }

func (a attachSource) resize(rows, cols int) error {
	if a.c.master == nil {
		return fmt.Errorf("container %s has no terminal (it was not created with tty)", a.c.ID)
	}
	return setWinsize(a.c.master, rows, cols)
}

// release: the session ended.
func (a attachSource) release(s *session) {
	s.forget()
	a.c.closeStdinOnce()
}

// closeStdinOnce: a stdin_once container's stdin closes when the session that used it ends.
func (c *container) closeStdinOnce() {
	c.stdinMu.Lock()
	defer c.stdinMu.Unlock()
	if c.stdin == nil || !c.stdinOnce || !c.stdinUsed {
		return
	}
	if c.stdin == c.master {
		eof := []byte{4}
		if !c.stdinNL {
			eof = []byte{4, 4}
		}
		c.stdin.SetWriteDeadline(time.Now().Add(time.Second))
		c.stdin.Write(eof)
	} else {
		c.stdin.Close()
	}
	c.stdin = nil
}
