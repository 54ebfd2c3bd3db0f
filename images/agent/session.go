package main

// Stream sessions: what streamed processes (stream.go), attach sessions (attach.go) and forwarded
// connections (forward.go) have in common. A session has an id in the registry of its kind, which
// holds a bounded number of them; one or two output streams whose bytes wait for the host in
// bounded buffers and are taken by a long poll (read); an input the host writes in bounded pieces
// with a deadline; the end of that input; and a release that ends the host's interest. What
// differs between the kinds is the source behind a session (a sessionSource: a process's pipes or
// terminal, a running container's stdio, a TCP connection), the names of their ops and of the
// field naming a session, and the fields of a read's answer: a kind's registry holds those.
//
// Output comes in two ways. A pump reads a source only while fewer than sessionBufMax bytes of its
// stream wait for the host, so a host that stops reading stops the writer (back-pressure, bounded
// memory). An offer (the tee of a container's output to its attach sessions) never blocks: what
// does not fit is counted as dropped.
//
// Lock order: a registry's lock, then a session's; a session's lock is never held while taking
// its registry's.

import (
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
)

const (
	sessionBufMax       = 256 << 10 // bytes of output per stream waiting for the host
	sessionReadChunk    = 32 << 10  // bytes a pump reads from its source at once
	sessionWriteMax     = 32 << 10  // bytes one write may carry
	sessionMaxPollMs    = 30000     // the longest a read or a write waits
	sessionWriteDefault = 10000     // ms a write waits when it names no (valid) timeout
	sessionLease        = 10 * time.Minute
)

// sessionSource is what is behind a session; write and closeInput are called one at a time.
type sessionSource interface {
	// write hands data to the session's input, waiting until deadline at most: the bytes taken,
	// and closed when the input is gone for good (the reader went away). An error refuses the
	// write; its text follows the op's name.
	write(data []byte, deadline time.Time) (n int, closed bool, err error)
	// closeInput passes the end of the host's input on.
	closeInput()
	// release lets go of what the source holds once the host is done, and calls s.forget once
	// nothing of it is left (a process: once it is reaped).
	release(s *session)
}

// terminal is a source with a terminal whose size the host sets.
type terminal interface {
	resize(rows, cols int) error
}

type outStream struct {
	buf []byte
	eof bool // the source gives no more
}

type session struct {
	id    string
	reg   *sessions
	src   sessionSource
	drain time.Duration // after the end, how long output may still arrive

	mu       sync.Mutex
	cond     *sync.Cond
	out      []outStream
	dropped  int64 // bytes offered that did not fit
	ended    bool  // the source ended (a process exited, a container stopped, a connection's EOF)
	endedAt  time.Time
	code     int
	released bool
	seen     time.Time

	endCh chan struct{} // closed at the end
	gone  chan struct{} // closed at the release
	wmu   sync.Mutex    // one write or close of the input at a time
	once  sync.Once
}

// newSession is a session of streams output streams (1 or 2) behind src, not yet in a registry.
func newSession(streams int, drain time.Duration, src sessionSource) *session {
	s := &session{src: src, drain: drain, out: make([]outStream, streams), seen: time.Now(),
		endCh: make(chan struct{}), gone: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	return s
}

func (s *session) wake() {
	s.mu.Lock()
	s.cond.Broadcast()
	s.mu.Unlock()
}

// shut marks stream i as giving nothing (a terminal has no stderr).
func (s *session) shut(i int) {
	s.mu.Lock()
	s.out[i].eof = true
	s.cond.Broadcast()
	s.mu.Unlock()
}

// pump moves what r gives into stream i while the stream has room, until r's end or the release.
func (s *session) pump(i int, r io.Reader) {
	tmp := make([]byte, sessionReadChunk)
	for {
		s.mu.Lock()
		for len(s.out[i].buf) >= sessionBufMax && !s.out[i].eof {
			s.cond.Wait()
		}
		done := s.out[i].eof
		s.mu.Unlock()
		if done {
			return
		}
		n, err := r.Read(tmp)
		s.mu.Lock()
		if n > 0 && !s.released {
			s.out[i].buf = append(s.out[i].buf, tmp[:n]...)
		}
		if err != nil {
			s.out[i].eof = true // EOF, or EIO from a terminal whose other side closed
		}
		s.cond.Broadcast()
		s.mu.Unlock()
	}
}

// offer adds b to stream i if it fits under sessionBufMax, else counts it as dropped.
func (s *session) offer(i int, b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.released {
		return
	}
	if len(s.out[i].buf)+len(b) > sessionBufMax {
		s.dropped += int64(len(b))
		return
	}
	s.out[i].buf = append(s.out[i].buf, b...)
	s.cond.Broadcast()
}

// end records that the source ended with code; the first call counts.
func (s *session) end(code int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return
	}
	s.ended, s.code, s.endedAt = true, code, time.Now()
	close(s.endCh)
	s.cond.Broadcast()
	if s.drain > 0 {
		time.AfterFunc(s.drain, s.wake) // a poll waiting for output that never came answers done
	}
}

// ends is closed once the source ended.
func (s *session) ends() <-chan struct{} { return s.endCh }

func (s *session) emptyLocked() bool {
	for _, o := range s.out {
		if len(o.buf) > 0 {
			return false
		}
	}
	return true
}

// finishedLocked: the source ended and its output was taken, every stream at its end or the
// drain time past the end.
func (s *session) finishedLocked() bool {
	if !s.ended || !s.emptyLocked() {
		return false
	}
	for _, o := range s.out {
		if !o.eof {
			return time.Since(s.endedAt) >= s.drain
		}
	}
	return true
}

// readResult is what one read took: output per stream, and the session's state after it.
type readResult struct {
	out     [][]byte // one per stream, never nil
	done    bool     // finished: nothing more will come
	code    int      // the source's exit code, once done
	dropped int64
}

// clampPoll is a poll's wait: ms, with a negative or too long one made the longest.
func clampPoll(ms int) time.Duration {
	if ms < 0 || ms > sessionMaxPollMs {
		ms = sessionMaxPollMs
	}
	return time.Duration(ms) * time.Millisecond
}

// read waits up to wait for output, the finish or the release, then takes at most max bytes, from
// the first stream first (max <= 0 or above sessionBufMax: sessionBufMax).
func (s *session) read(max int, wait time.Duration) readResult {
	if max <= 0 || max > sessionBufMax {
		max = sessionBufMax
	}
	deadline := time.Now().Add(wait)
	t := time.AfterFunc(wait, s.wake)
	defer t.Stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.emptyLocked() && !s.finishedLocked() && !s.released && time.Now().Before(deadline) {
		s.cond.Wait()
	}
	r := readResult{out: make([][]byte, len(s.out))}
	for i := range s.out {
		o := &s.out[i]
		n := len(o.buf)
		if n > max {
			n = max
		}
		r.out[i] = append(make([]byte, 0, n), o.buf[:n]...)
		o.buf = o.buf[n:]
		if len(o.buf) == 0 {
			o.buf = nil
		}
		max -= n
	}
	s.cond.Broadcast() // room again for the pumps
	r.done, r.code, r.dropped = s.finishedLocked(), s.code, s.dropped
	return r
}

// waitEnd waits up to wait for the source's end: whether it ended, and its code.
func (s *session) waitEnd(wait time.Duration) (bool, int) {
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-s.endCh:
	case <-t.C:
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ended, s.code
}

func (s *session) write(data []byte, deadline time.Time) (int, bool, error) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.src.write(data, deadline)
}

func (s *session) closeInput() {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	s.src.closeInput()
}

// close ends the host's interest: the output is dropped, waiting polls and pumps return, and the
// source lets go of what it holds. Only the first call counts.
func (s *session) close() {
	s.once.Do(func() {
		s.mu.Lock()
		s.released = true
		for i := range s.out {
			s.out[i].buf, s.out[i].eof = nil, true
		}
		close(s.gone)
		s.cond.Broadcast()
		s.mu.Unlock()
		s.src.release(s)
	})
}

// forget takes the session out of its registry (its id is unknown from then on).
func (s *session) forget() {
	if s.reg != nil {
		s.reg.forget(s)
	}
}

// sessions is the registry of one kind of session, with the wire names of its ops and fields.
type sessions struct {
	idField string                // the args field naming a session ("proc", "attach", "conn")
	max     int                   // sessions at once, counting those being opened
	unknown func(id string) error // the error for an id the registry does not hold
	full    func(count int) error // the error when max sessions are open
	answer  func(readResult) map[string]interface{}

	mu      sync.Mutex
	m       map[string]*session
	n       int // ids given so far
	pending int // slots reserved by opens under way
}

// sessionOps names the ops of a kind; an empty name: the kind has no such op.
type sessionOps struct {
	read, write, closeInput, resize, release string
}

// registries are every kind's registry, for the leases (leases.go).
var registries = []*sessions{procs, attaches, fwds}

// register installs the handlers of r's ops.
func (r *sessions) register(ops sessionOps) {
	handlers[ops.read] = r.opRead
	handlers[ops.write] = r.opWrite(ops.write)
	handlers[ops.closeInput] = r.opCloseInput
	handlers[ops.release] = r.opRelease
	if ops.resize != "" {
		handlers[ops.resize] = r.opResize(ops.resize)
	}
}

// reserve takes a slot for a session being opened and gives its id; add or unreserve ends it.
func (r *sessions) reserve() (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if count := len(r.m) + r.pending; count >= r.max {
		return "", r.full(count)
	}
	r.pending++
	r.n++
	return strconv.Itoa(r.n), nil
}

func (r *sessions) unreserve() {
	r.mu.Lock()
	r.pending--
	r.mu.Unlock()
}

// add puts s, opened under the reserved id, in the registry.
func (r *sessions) add(id string, s *session) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pending--
	if r.m == nil {
		r.m = map[string]*session{}
	}
	s.id, s.reg = id, r
	r.m[id] = s
}

func (r *sessions) forget(s *session) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m[s.id] == s {
		delete(r.m, s.id)
	}
}

// lookup is the session the args name, marked as seen now.
func (r *sessions) lookup(raw json.RawMessage) (*session, error) {
	id, err := r.parseID(raw)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	s, ok := r.m[id]
	if !ok {
		return nil, r.unknown(id)
	}
	s.mu.Lock()
	s.seen = time.Now()
	s.mu.Unlock()
	return s, nil
}

// parseID reads the string field idField of the args, as a struct with that one field reads it
// (the errors for args of the wrong shape say so).
func (r *sessions) parseID(raw json.RawMessage) (string, error) {
	name := strings.ToUpper(r.idField[:1]) + r.idField[1:]
	t := reflect.StructOf([]reflect.StructField{{Name: name, Type: reflect.TypeOf(""),
		Tag: reflect.StructTag(`json:"` + r.idField + `"`)}})
	v := reflect.New(t)
	if err := json.Unmarshal(raw, v.Interface()); err != nil {
		return "", err
	}
	return v.Elem().Field(0).String(), nil
}

// each calls fn on every session, under the registry's lock.
func (r *sessions) each(fn func(*session)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.m {
		fn(s)
	}
}

// idle gives the release of every session no request touched for longer than idle (0: every one).
func (r *sessions) idle(idle time.Duration) []func() {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []func()
	for _, s := range r.m {
		s.mu.Lock()
		if idle == 0 || time.Since(s.seen) > idle {
			out = append(out, s.close)
		}
		s.mu.Unlock()
	}
	return out
}

// X_read: {ID,"max_bytes","timeout_ms" (at most 30000)} -> the kind's answer, once output is
// there, the session finished, or the timeout passed.
func (r *sessions) opRead(raw json.RawMessage) (interface{}, error) {
	s, err := r.lookup(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		MaxBytes  int `json:"max_bytes"`
		TimeoutMs int `json:"timeout_ms"`
	}
	json.Unmarshal(raw, &a)
	return r.answer(s.read(a.MaxBytes, clampPoll(a.TimeoutMs))), nil
}

// X_write: {ID,"data" (base64, at most sessionWriteMax),"timeout_ms"} -> {"written"}, with
// "closed" once the input is gone for good.
func (r *sessions) opWrite(op string) handler {
	return func(raw json.RawMessage) (interface{}, error) {
		s, err := r.lookup(raw)
		if err != nil {
			return nil, err
		}
		var a struct {
			Data      []byte `json:"data"`
			TimeoutMs int    `json:"timeout_ms"`
		}
		if err := json.Unmarshal(raw, &a); err != nil {
			return nil, fmt.Errorf("%s: %v", op, err)
		}
		if len(a.Data) > sessionWriteMax {
			return nil, fmt.Errorf("%s: %d bytes at once (at most %d)", op, len(a.Data), sessionWriteMax)
		}
		if a.TimeoutMs <= 0 || a.TimeoutMs > sessionMaxPollMs {
			a.TimeoutMs = sessionWriteDefault
		}
		n, closed, err := s.write(a.Data, time.Now().Add(time.Duration(a.TimeoutMs)*time.Millisecond))
		if err != nil {
			return nil, fmt.Errorf("%s: %v", op, err)
		}
		if closed {
			return map[string]interface{}{"written": n, "closed": true}, nil
		}
		return map[string]interface{}{"written": n}, nil
	}
}

// X_close_stdin / tcp_close_write: {ID} -> {}
func (r *sessions) opCloseInput(raw json.RawMessage) (interface{}, error) {
	s, err := r.lookup(raw)
	if err != nil {
		return nil, err
	}
	s.closeInput()
	return nil, nil
}

// X_resize: {ID,"rows","cols"} -> {}; a session without a terminal is refused.
func (r *sessions) opResize(op string) handler {
	return func(raw json.RawMessage) (interface{}, error) {
		s, err := r.lookup(raw)
		if err != nil {
			return nil, err
		}
		var a struct {
			Rows int `json:"rows"`
			Cols int `json:"cols"`
		}
		if err := json.Unmarshal(raw, &a); err != nil {
			return nil, fmt.Errorf("%s: %v", op, err)
		}
		t, ok := s.src.(terminal)
		if !ok {
			return nil, fmt.Errorf("%s: the session has no terminal", op)
		}
		if err := t.resize(a.Rows, a.Cols); err != nil {
			return nil, fmt.Errorf("%s: %v", op, err)
		}
		return nil, nil
	}
}

// X_release / tcp_close: {ID} -> {}: the host is done; releasing what is gone already is no error.
func (r *sessions) opRelease(raw json.RawMessage) (interface{}, error) {
	s, err := r.lookup(raw)
	if err != nil {
		return nil, nil
	}
	s.close()
	return nil, nil
}
