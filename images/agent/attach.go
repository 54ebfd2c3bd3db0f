package main

// Attach (the CRI's streaming Attach): sessions on a running container's own stdio. The
// container's output reaches its CRI log as always and, a line at a time, every attached session;
// a session that the host does not read keeps at most attachBufMax bytes per stream and counts
// the rest as dropped, so an attached client can never stall the container or its log. A
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
	"strconv"
	"sync"
	"time"
)

const attachBufMax = 256 << 10

type attachSession struct {
	id      string
	c       *container
	out     [2][]byte
	dropped int64
	seen    time.Time
}

var attaches struct {
	sync.Mutex
	cond *sync.Cond
	m    map[string]*attachSession
	n    int
}

func init() {
	attaches.cond = sync.NewCond(&attaches.Mutex)
	attaches.m = map[string]*attachSession{}
	handlers["attach_open"] = opAttachOpen
	handlers["attach_read"] = opAttachRead
	handlers["attach_write"] = opAttachWrite
	handlers["attach_close_stdin"] = opAttachCloseStdin
	handlers["attach_release"] = opAttachRelease
	handlers["attach_resize"] = opAttachResize
	go janitor(idleAttaches)
}

// attachTee hands a line of the container's output (stream 0 stdout, 1 stderr) to its sessions.
func attachTee(c *container, stream int) func([]byte) {
	return func(b []byte) {
		attaches.Lock()
		defer attaches.Unlock()
		for _, s := range attaches.m {
			if s.c != c {
				continue
			}
			if len(s.out[stream])+len(b) > attachBufMax {
				s.dropped += int64(len(b))
				continue
			}
			s.out[stream] = append(s.out[stream], b...)
		}
		attaches.cond.Broadcast()
	}
}

func lookupAttach(raw json.RawMessage) (*attachSession, error) {
	var a struct {
		Attach string `json:"attach"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	attaches.Lock()
	defer attaches.Unlock()
	s, ok := attaches.m[a.Attach]
	if !ok {
		return nil, fmt.Errorf("no attach session %q", a.Attach)
	}
	s.seen = time.Now()
	return s, nil
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
	attaches.Lock()
	defer attaches.Unlock()
	if len(attaches.m) >= procMaxLive {
		return nil, fmt.Errorf("attach: %d sessions already in this guest", procMaxLive)
	}
	attaches.n++
	s := &attachSession{id: strconv.Itoa(attaches.n), c: c, seen: time.Now()}
	attaches.m[s.id] = s
	return map[string]interface{}{"attach": s.id}, nil
}

func (s *attachSession) finishedLocked() bool {
	select {
	case <-s.c.done:
		return len(s.out[0]) == 0 && len(s.out[1]) == 0
	default:
		return false
	}
}

// attach_read: {"attach","max_bytes","timeout_ms"} -> {"stdout","stderr","done","dropped_bytes"}
func opAttachRead(raw json.RawMessage) (interface{}, error) {
	s, err := lookupAttach(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		MaxBytes  int `json:"max_bytes"`
		TimeoutMs int `json:"timeout_ms"`
	}
	json.Unmarshal(raw, &a)
	if a.MaxBytes <= 0 || a.MaxBytes > attachBufMax {
		a.MaxBytes = attachBufMax
	}
	if a.TimeoutMs < 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = procMaxPollMs
	}
	wait := time.Duration(a.TimeoutMs) * time.Millisecond
	deadline := time.Now().Add(wait)
	wake := func() { attaches.Lock(); attaches.cond.Broadcast(); attaches.Unlock() }
	t := time.AfterFunc(wait, wake)
	defer t.Stop()
	go func() { // the container's exit wakes the poll too
		select {
		case <-s.c.done:
			wake()
		case <-time.After(wait):
		}
	}()
	attaches.Lock()
	defer attaches.Unlock()
	for len(s.out[0]) == 0 && len(s.out[1]) == 0 && !s.finishedLocked() && time.Now().Before(deadline) {
		if _, live := attaches.m[s.id]; !live {
			break
		}
		attaches.cond.Wait()
	}
	var got [2][]byte
	room := a.MaxBytes
	for i := range got {
		n := len(s.out[i])
		if n > room {
			n = room
		}
		got[i] = append([]byte(nil), s.out[i][:n]...)
		s.out[i] = s.out[i][n:]
		room -= n
	}
	return map[string]interface{}{"stdout": got[0], "stderr": got[1], "done": s.finishedLocked(),
		"dropped_bytes": s.dropped}, nil
}

// attach_write: {"attach","data" (base64, at most procWriteMax),"timeout_ms"} -> {"written","closed"}
func opAttachWrite(raw json.RawMessage) (interface{}, error) {
	s, err := lookupAttach(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		Data      []byte `json:"data"`
		TimeoutMs int    `json:"timeout_ms"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("attach_write: %v", err)
	}
	if len(a.Data) > procWriteMax {
		return nil, fmt.Errorf("attach_write: %d bytes at once (at most %d)", len(a.Data), procWriteMax)
	}
	if a.TimeoutMs <= 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = 10000
	}
	c := s.c
	c.stdinMu.Lock()
	defer c.stdinMu.Unlock()
	if c.stdin == nil {
		return map[string]interface{}{"written": 0, "closed": true}, nil
	}
	c.stdinUsed = true
	c.stdin.SetWriteDeadline(time.Now().Add(time.Duration(a.TimeoutMs) * time.Millisecond))
	n, err := c.stdin.Write(a.Data)
	if n > 0 {
		c.stdinNL = a.Data[n-1] == '\n' || a.Data[n-1] == '\r'
	}
	if err != nil && !os.IsTimeout(err) {
		return map[string]interface{}{"written": n, "closed": true}, nil
	}
	return map[string]interface{}{"written": n}, nil
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

// attach_resize: {"attach","rows","cols"} -> {}; a container without a terminal is refused.
func opAttachResize(raw json.RawMessage) (interface{}, error) {
	s, err := lookupAttach(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		Rows int `json:"rows"`
		Cols int `json:"cols"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("attach_resize: %v", err)
	}
	if s.c.master == nil {
		return nil, fmt.Errorf("attach_resize: container %s has no terminal (it was not created with tty)", s.c.ID)
	}
	if err := setWinsize(s.c.master, a.Rows, a.Cols); err != nil {
		return nil, fmt.Errorf("attach_resize: %v", err)
	}
	return nil, nil
}

// attach_close_stdin: {"attach"} -> {}: the client closed its stdin.
func opAttachCloseStdin(raw json.RawMessage) (interface{}, error) {
	s, err := lookupAttach(raw)
	if err != nil {
		return nil, err
	}
	s.c.closeStdinOnce()
	return nil, nil
}

// attach_release: {"attach"} -> {}: the session ended.
func opAttachRelease(raw json.RawMessage) (interface{}, error) {
	s, err := lookupAttach(raw)
	if err != nil {
		return nil, nil
	}
	s.release()
	return nil, nil
}

func (s *attachSession) release() {
	attaches.Lock()
	delete(attaches.m, s.id)
	attaches.cond.Broadcast()
	attaches.Unlock()
	s.c.closeStdinOnce()
}
