package main

// The kubelet's side (HTTP/2 server role): each connection's streams, read whole, then sent on
// the path route.go picks for them. A request is complete before it goes anywhere (every CRI call
// has one request message), so a stream is dispatched once, from the connection's read loop.
// What a client may make the front hold is bounded: streams and request bytes per connection,
// request bytes against the front's budget (limits.go), and streams it resets per second; and
// for how long: its handshake, and a connection idle (no stream, no frame) ends with a GOAWAY.

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

const (
	maxStreams     = 1000     // at once on one connection
	maxConnBuffers = 64 << 20 // request bytes (header lists and bodies) held at once on one connection
	maxResets      = 100      // streams a client may reset while they are served, per resetWindow
	resetWindow    = time.Second
)

type client struct {
	*conn
	f *front

	mu      sync.Mutex
	streams map[uint32]*stream
	lastID  uint32
	held    int  // request bytes of its streams (their stream.held)
	idle    bool // told to go away for being idle: no new stream is served

	lastActive atomic.Int64 // unix nanoseconds: its last frame, or the end of its last stream
	idleT      *time.Timer  // under wmu

	// read loop only
	resets      int
	resetsSince time.Time
}

// stream is one call of a client: its request as read, then the call it was sent on.
type stream struct {
	id      uint32
	c       *client
	path    string
	hdrs    []hpack.HeaderField
	body    []byte
	unacked uint32
	started time.Time
	ended   bool // the request is whole and on its way (under client.mu)
	held    int  // its bytes counted in client.held and the front's budget (under client.mu)
	gone    bool // done: held was given back (under client.mu)

	mu     sync.Mutex
	ups    []*call // what it waits on
	closed bool    // answered, or cancelled by the client
}

// accept serves each connection of ln until ln fails; one beyond maxConns is refused.
func (f *front) accept(ln net.Listener) error {
	for {
		nc, err := ln.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
				errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM) {
				time.Sleep(100 * time.Millisecond) // out of descriptors: the connections we have end first
				continue
			}
			return err
		}
		if f.conns.Add(1) > int64(f.maxConns) {
			f.conns.Add(-1)
			refuse(nc)
			f.logf("a connection beyond %d refused", f.maxConns)
			continue
		}
		go f.serveConn(nc)
	}
}

func (f *front) serveConn(nc net.Conn) {
	lim := clientOut
	lim.budget = f.budget
	lim.pendingMax = f.connPending
	lim.stall = f.windowTimeout
	c := &client{conn: newConn(nc, lim), f: f, streams: map[uint32]*stream{}}
	c.stalled = c.stalledStreams
	c.w.onDone = func() { f.conns.Add(-1) } // its socket is closed: the slot is free
	defer c.shutdown()
	// the preface and the SETTINGS after it come within handshakeTimeout, or the connection ends
	_ = nc.SetReadDeadline(time.Now().Add(f.handshakeTimeout))
	if err := c.handshake(true); err != nil {
		return
	}
	err := c.readLoop()
	if code, ok := goAwayCode(err); ok {
		c.mu.Lock()
		last := c.lastID
		c.mu.Unlock()
		c.goAway(last, code)
		f.logf("client connection: %v", err)
	}
}

// readLoop reads the client's frames until its connection ends; the error says why.
func (c *client) readLoop() error {
	first := true
	for {
		fr, err := c.fr.ReadFrame()
		if err == nil {
			c.lastActive.Store(time.Now().UnixNano())
		}
		if err == nil && first { // RFC 9113 3.4: the preface ends with SETTINGS
			if sf, ok := fr.(*http2.SettingsFrame); !ok || sf.IsAck() {
				return connErr{http2.ErrCodeProtocol, "no SETTINGS after the preface"}
			}
			first = false
			c.settledIn()
		}
		if err == nil {
			var handled bool
			if handled, err = c.control(fr); !handled {
				err = c.frame(fr)
			}
		}
		var se http2.StreamError
		if errors.As(err, &se) { // one stream's fault (a malformed header, say): that stream ends
			c.streamError(se)
			continue
		}
		if err != nil {
			return err
		}
	}
}

// settledIn: the client's preface and SETTINGS have come; from now it may be idle.
func (c *client) settledIn() {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.dead() {
		return
	}
	_ = c.nc.SetReadDeadline(time.Time{})
	if c.f.idleTimeout > 0 {
		c.idleT = time.AfterFunc(c.f.idleTimeout, c.idleCheck)
	}
}

// idleCheck ends the connection with GOAWAY NO_ERROR once it has had no open stream (a reply
// still waiting for window counts as open) and no frame from the client for idleTimeout; a
// connection that carries calls, as the kubelet's does every few seconds, is never idle.
func (c *client) idleCheck() {
	now := time.Now()
	c.mu.Lock()
	busy := len(c.streams) > 0
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.dead() {
		c.mu.Unlock()
		return
	}
	if busy || len(c.out) > 0 {
		c.lastActive.Store(now.UnixNano())
	}
	if left := c.f.idleTimeout - now.Sub(time.Unix(0, c.lastActive.Load())); left > 0 {
		c.mu.Unlock()
		c.idleT.Reset(left)
		return
	}
	c.idle = true // a stream it opens from now is refused: the GOAWAY names the last one served
	last := c.lastID
	c.mu.Unlock()
	_ = c.fr.WriteGoAway(last, http2.ErrCodeNo, []byte("idle"))
	_ = c.flushLocked()
	c.w.closeLocked()
}

// stalledStreams: the streams were reset for a reply that waited too long for the client's
// window; what they wait on is cancelled.
func (c *client) stalledStreams(ids []uint32) {
	for _, id := range ids {
		c.mu.Lock()
		s := c.streams[id]
		c.mu.Unlock()
		if s != nil {
			s.abandon()
		}
	}
	c.f.logf("client connection: %d stream(s) reset, their replies waited %v for its window", len(ids), c.lim.stall)
}

func (c *client) streamError(se http2.StreamError) {
	c.mu.Lock()
	s := c.streams[se.StreamID]
	if se.StreamID > c.lastID && se.StreamID%2 == 1 {
		c.lastID = se.StreamID
	}
	c.mu.Unlock()
	if s != nil {
		s.abandon()
	}
	c.reset(se.StreamID, se.Code)
}

// shutdown cancels what the connection's calls still wait on, and closes it.
func (c *client) shutdown() {
	c.mu.Lock()
	streams := c.streams
	c.streams = map[uint32]*stream{}
	c.mu.Unlock()
	for _, s := range streams {
		s.abandon()
	}
	c.wmu.Lock()
	for id := range c.out { // replies of streams already answered, waiting for window
		c.dropLocked(id)
	}
	c.stopTimersLocked()
	if c.idleT != nil {
		c.idleT.Stop()
	}
	c.w.closeLocked()
	c.wmu.Unlock()
}

// headerSize is what a header list counts for (RFC 9113 6.5.2: 32 bytes a field besides its own).
func headerSize(fields []hpack.HeaderField) int {
	n := 0
	for _, f := range fields {
		n += int(f.Size())
	}
	return n
}

func (c *client) frame(fr http2.Frame) error {
	switch fr := fr.(type) {
	case *http2.MetaHeadersFrame:
		return c.headers(fr)
	case *http2.DataFrame:
		return c.data(fr)
	case *http2.RSTStreamFrame:
		c.mu.Lock()
		s := c.streams[fr.StreamID]
		idle := fr.StreamID > c.lastID
		c.mu.Unlock()
		if idle {
			return connErr{http2.ErrCodeProtocol, fmt.Sprintf("RST_STREAM on idle stream %d", fr.StreamID)}
		}
		if s == nil {
			return nil // a stream that is over: nothing to cancel
		}
		s.abandon()
		now := time.Now()
		if now.Sub(c.resetsSince) >= resetWindow {
			c.resetsSince, c.resets = now, 0
		}
		if c.resets++; c.resets > maxResets {
			return connErr{http2.ErrCodeEnhanceYourCalm, fmt.Sprintf("more than %d streams reset in %v", maxResets, resetWindow)}
		}
	case *http2.PushPromiseFrame:
		return connErr{http2.ErrCodeProtocol, "PUSH_PROMISE from a client"}
	case *http2.GoAwayFrame:
		// the client sends nothing new; what it has sent is still answered
	}
	return nil
}

func (c *client) headers(fr *http2.MetaHeadersFrame) error {
	id := fr.StreamID
	c.mu.Lock()
	if s := c.streams[id]; s != nil { // trailers of a request: CRI calls send none, but they end it
		ended := s.ended
		c.mu.Unlock()
		switch {
		case ended:
			c.reset(id, http2.ErrCodeStreamClosed)
		case fr.Truncated:
			s.answer(codeResourceExhausted, fmt.Sprintf("request trailers larger than %d bytes", maxHeaderList))
		case fr.StreamEnded():
			c.dispatch(s)
		}
		return nil
	}
	if id%2 == 0 || id <= c.lastID {
		c.mu.Unlock()
		return connErr{http2.ErrCodeProtocol, fmt.Sprintf("stream %d: not a new client stream", id)}
	}
	c.lastID = id
	size := headerSize(fr.Fields)
	if c.idle || len(c.streams) >= maxStreams || c.held+size > maxConnBuffers || !c.f.budget.take(size) {
		c.mu.Unlock()
		c.reset(id, http2.ErrCodeRefusedStream)
		return nil
	}
	c.held += size
	s := &stream{id: id, c: c, hdrs: fr.Fields, path: fr.PseudoValue("path"), started: time.Now(), held: size}
	c.streams[id] = s
	c.mu.Unlock()
	c.wmu.Lock()
	c.openLocked(id)
	c.wmu.Unlock()
	switch {
	case fr.Truncated: // what was kept of it is not the request: it goes nowhere
		s.answer(codeResourceExhausted, fmt.Sprintf("request header list larger than %d bytes", maxHeaderList))
	case fr.StreamEnded():
		c.dispatch(s)
	}
	return nil
}

func (c *client) data(fr *http2.DataFrame) error {
	id := fr.StreamID
	c.mu.Lock()
	if id > c.lastID {
		c.mu.Unlock()
		return connErr{http2.ErrCodeProtocol, fmt.Sprintf("DATA on idle stream %d", id)}
	}
	s := c.streams[id]
	if s != nil && s.ended { // data after the request's end: the stream is closed to it
		c.mu.Unlock()
		c.received(id, fr.Length, nil)
		c.reset(id, http2.ErrCodeStreamClosed)
		return nil
	}
	n := len(fr.Data())
	why := ""
	if s != nil {
		switch {
		case len(s.body)+n > maxMessage+5:
			why = fmt.Sprintf("request larger than %d bytes", maxMessage)
		case c.held+n > maxConnBuffers || !c.f.budget.take(n):
			why = "the front holds as many request bytes as it takes; try again"
		default:
			s.body = append(s.body, fr.Data()...)
			c.held += n
			s.held += n
		}
	}
	c.mu.Unlock()
	if s == nil {
		c.received(id, fr.Length, nil)
		return nil
	}
	c.received(id, fr.Length, &s.unacked)
	if why != "" {
		s.answer(codeResourceExhausted, why)
		return nil
	}
	if fr.StreamEnded() {
		c.dispatch(s)
	}
	return nil
}

func (c *client) dispatch(s *stream) {
	c.mu.Lock()
	s.ended = true // the request is whole: nothing more of it is read
	c.mu.Unlock()
	c.f.serve(s)
}

// done forgets a stream that has been answered or given up; its bytes are no longer held.
func (s *stream) done() {
	c := s.c
	c.mu.Lock()
	if !s.gone {
		s.gone, s.ended = true, true
		c.held -= s.held
		c.f.budget.give(s.held)
	}
	delete(c.streams, s.id)
	c.lastActive.Store(time.Now().UnixNano()) // an idle connection's time starts at its last stream's end
	c.mu.Unlock()
}

// wait records a call the stream now waits on; false if the stream is already over.
func (s *stream) wait(up *call) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.ups = append(s.ups, up)
	return true
}

// settled forgets the calls the stream waited on (they have answered); false if it is over.
func (s *stream) settled() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ups = nil
	return !s.closed
}

// abandon is the client's cancel (or its connection's end): the calls waited on are cancelled.
func (s *stream) abandon() {
	s.mu.Lock()
	ups := s.ups
	s.closed = true
	s.ups = nil
	s.mu.Unlock()
	for _, up := range ups {
		up.cancel()
	}
	s.c.forget(s.id)
	s.done()
}

// finishing marks the stream answered; false if it was already (or the client gave up).
func (s *stream) finishing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.closed = true
	s.ups = nil
	return true
}

// reply sends a whole reply: headers, the body (if any) and trailers.
func (s *stream) reply(hdrs []hpack.HeaderField, body []byte, trailers []hpack.HeaderField) {
	if !s.finishing() {
		return
	}
	items := []item{{headers: hdrs, end: trailers == nil && len(body) == 0}}
	if len(body) > 0 {
		items = append(items, item{data: body, end: trailers == nil})
	}
	if trailers != nil {
		items = append(items, item{headers: trailers, end: true})
	}
	s.c.send(s.id, items...)
	s.done()
}

// answer ends the stream with a status of the front's own (trailers-only).
func (s *stream) answer(code int, msg string) {
	s.reply(statusOnly(code, msg), nil, nil)
}

// gRPC status codes the front answers with itself
const (
	codeOK                = 0
	codeUnimplemented     = 12
	codeResourceExhausted = 8
	codeUnavailable       = 14
	codeDeadlineExceeded  = 4
)

func statusOnly(code int, msg string) []hpack.HeaderField {
	return []hpack.HeaderField{
		{Name: ":status", Value: "200"},
		{Name: "content-type", Value: "application/grpc"},
		{Name: "grpc-status", Value: fmt.Sprint(code)},
		{Name: "grpc-message", Value: percentEncode(bound(msg, 1024))},
	}
}

func bound(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// percentEncode is grpc-message's encoding: printable ASCII but '%' as is, the rest %XX.
func percentEncode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		ch := s[i]
		if ch >= 0x20 && ch <= 0x7e && ch != '%' {
			b.WriteByte(ch)
		} else {
			fmt.Fprintf(&b, "%%%02X", ch)
		}
	}
	return b.String()
}

// header is a field's value in a header block ("" when absent).
func header(fields []hpack.HeaderField, name string) string {
	for _, f := range fields {
		if f.Name == name {
			return f.Value
		}
	}
	return ""
}

// forwardHeaders is a request's header block as it goes on: the client's own vmsandbox-* fields
// dropped, grpc-timeout lowered by the time already spent, then extra appended.
func (s *stream) forwardHeaders(extra ...hpack.HeaderField) []hpack.HeaderField {
	out := make([]hpack.HeaderField, 0, len(s.hdrs)+len(extra))
	for _, f := range s.hdrs {
		if strings.HasPrefix(f.Name, headerPrefix) {
			continue
		}
		if f.Name == "grpc-timeout" {
			if d, ok := parseTimeout(f.Value); ok {
				f.Value = formatTimeout(d - time.Since(s.started))
			}
		}
		out = append(out, hpack.HeaderField{Name: f.Name, Value: f.Value, Sensitive: f.Sensitive})
	}
	return append(out, extra...)
}

// deadline is what is left of the caller's grpc-timeout (ok false: it set none).
func (s *stream) deadline() (time.Duration, bool) {
	d, ok := parseTimeout(header(s.hdrs, "grpc-timeout"))
	if !ok {
		return 0, false
	}
	return d - time.Since(s.started), true
}
