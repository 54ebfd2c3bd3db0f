package main

// The kubelet's side (HTTP/2 server role): each connection's streams, read whole, then sent on
// the path route.go picks for them. A request is complete before it goes anywhere (every CRI call
// has one request message), so a stream is dispatched once, from the connection's read loop.

import (
	"fmt"
	"log"
	"net"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

const (
	maxStreams     = 1000      // at once on one connection
	maxConnBuffers = 256 << 20 // request bytes held at once on one connection
)

type client struct {
	*conn
	f *front

	mu       sync.Mutex
	streams  map[uint32]*stream
	lastID   uint32
	buffered int
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

	mu     sync.Mutex
	ups    []*call // what it waits on
	closed bool    // answered, or cancelled by the client
}

// accept serves each connection of ln until ln fails.
func (f *front) accept(ln net.Listener) error {
	for {
		nc, err := ln.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			return err
		}
		go f.serveConn(nc)
	}
}

func (f *front) serveConn(nc net.Conn) {
	c := &client{conn: newConn(nc), f: f, streams: map[uint32]*stream{}}
	defer c.shutdown()
	if err := c.handshake(true); err != nil {
		return
	}
	for {
		fr, err := c.fr.ReadFrame()
		if se, ok := err.(http2.StreamError); ok { // one stream's fault (a malformed header): that stream ends
			c.mu.Lock()
			s := c.streams[se.StreamID]
			if se.StreamID > c.lastID {
				c.lastID = se.StreamID
			}
			c.mu.Unlock()
			if s != nil {
				s.abandon()
			}
			c.reset(se.StreamID, se.Code)
			continue
		}
		if err != nil {
			if ce, ok := err.(http2.ConnectionError); ok {
				c.goAway(http2.ErrCode(ce))
			}
			return
		}
		if handled, err := c.control(fr); handled {
			if err != nil {
				return
			}
			continue
		}
		if err := c.frame(fr); err != nil {
			log.Printf("client connection: %v", err)
			c.goAway(http2.ErrCodeProtocol)
			return
		}
	}
}

func (c *client) goAway(code http2.ErrCode) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	last := c.lastID
	c.mu.Unlock()
	_ = c.fr.WriteGoAway(last, code, nil)
	_ = c.flushLocked()
}

// shutdown cancels what the connection's calls still wait on.
func (c *client) shutdown() {
	c.close()
	c.mu.Lock()
	streams := c.streams
	c.streams = map[uint32]*stream{}
	c.mu.Unlock()
	for _, s := range streams {
		s.abandon()
	}
}

func (c *client) frame(fr http2.Frame) error {
	switch fr := fr.(type) {
	case *http2.MetaHeadersFrame:
		id := fr.StreamID
		c.mu.Lock()
		if s := c.streams[id]; s != nil { // trailers of a request: CRI calls send none, but they end it
			ended := s.ended
			c.mu.Unlock()
			if ended {
				c.reset(id, http2.ErrCodeStreamClosed)
			} else if fr.StreamEnded() {
				c.dispatch(s)
			}
			return nil
		}
		if id%2 == 0 || id <= c.lastID {
			c.mu.Unlock()
			return fmt.Errorf("stream %d: not a new client stream", id)
		}
		c.lastID = id
		if len(c.streams) >= maxStreams {
			c.mu.Unlock()
			c.reset(id, http2.ErrCodeRefusedStream)
			return nil
		}
		s := &stream{id: id, c: c, hdrs: fr.Fields, path: fr.PseudoValue("path"), started: time.Now()}
		c.streams[id] = s
		c.mu.Unlock()
		c.wmu.Lock()
		c.openLocked(id)
		c.wmu.Unlock()
		if fr.StreamEnded() {
			c.dispatch(s)
		}
	case *http2.DataFrame:
		c.mu.Lock()
		s := c.streams[fr.StreamID]
		n := len(fr.Data())
		if s != nil && s.ended { // data after the request's end: the stream is closed to it
			c.mu.Unlock()
			c.received(fr.StreamID, fr.Length, nil)
			c.reset(fr.StreamID, http2.ErrCodeStreamClosed)
			return nil
		}
		over := s != nil && (len(s.body)+n > maxMessage+5 || c.buffered+n > maxConnBuffers)
		if s != nil && !over {
			s.body = append(s.body, fr.Data()...)
			c.buffered += n
		}
		c.mu.Unlock()
		if s == nil {
			c.received(fr.StreamID, fr.Length, nil)
			return nil
		}
		c.received(fr.StreamID, fr.Length, &s.unacked)
		if over {
			s.answer(codeResourceExhausted, fmt.Sprintf("request larger than %d bytes", maxMessage))
			return nil
		}
		if fr.StreamEnded() {
			c.dispatch(s)
		}
	case *http2.RSTStreamFrame:
		c.mu.Lock()
		s := c.streams[fr.StreamID]
		c.mu.Unlock()
		if s != nil {
			s.abandon()
		}
	case *http2.GoAwayFrame:
		// the client sends nothing new; what it has sent is still answered
	}
	return nil
}

func (c *client) dispatch(s *stream) {
	c.mu.Lock()
	c.buffered -= len(s.body)
	s.ended = true // the request is whole: nothing more of it is read
	c.mu.Unlock()
	c.f.serve(s)
}

// done forgets a stream that has been answered or given up.
func (s *stream) done() {
	c := s.c
	c.mu.Lock()
	if !s.ended { // given up before its request was whole: its bytes are no longer held
		c.buffered -= len(s.body)
		s.ended = true
	}
	delete(c.streams, s.id)
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
