package main

// One HTTP/2 connection, in either role: the framer (reading through blockGuard), the write side
// (one lock, one HPACK encoder, the peer's flow-control windows held to 2^31-1, frames that wait
// for window or for room in the peer's queue), the peer's SETTINGS checked against RFC 9113, and
// receive-side window refills. Frames are read by one goroutine per connection (its owner's read
// loop); everything written goes through the write lock into the peer's own queue (writer.go), so
// that no caller ever waits on the peer's socket.

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

const (
	clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	// what we let a peer send before we refill: a stream's window and the connection's
	recvStreamWindow = 1 << 20
	recvConnWindow   = 1 << 24
	defaultWindow    = 65535 // RFC 9113 6.9.2
	maxWindow        = 1<<31 - 1
	defaultMaxFrame  = 16384
	maxFrameLimit    = 1<<24 - 1
	maxHeaderList    = 64 << 10 // a larger header block ends its stream (or, past maxBlockBytes, the connection)
	maxPendingBytes  = 32 << 20 // a stream whose peer stops reading is reset beyond this
	// data waiting for a client's window, all its streams: the largest reply the kubelet takes,
	// and room for a few small ones beside it
	maxConnPending = maxMessage + 1<<20
)

// connErr ends a connection with a GOAWAY of its code.
type connErr struct {
	code http2.ErrCode
	why  string
}

func (e connErr) Error() string { return fmt.Sprintf("%s (%v)", e.why, e.code) }

// goAwayCode is the GOAWAY a read error calls for; false: none (the peer is gone, or was cut).
func goAwayCode(err error) (http2.ErrCode, bool) {
	var ce connErr
	var ne net.Error
	switch {
	case errors.As(err, &ce):
		return ce.code, true
	case errors.Is(err, http2.ErrFrameTooLarge):
		return http2.ErrCodeFrameSize, true
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed),
		errors.Is(err, errConnClosed), errors.As(err, &ne):
		return 0, false
	}
	if code, ok := err.(http2.ConnectionError); ok {
		return http2.ErrCode(code), true
	}
	return http2.ErrCodeProtocol, true // the framer's own errors: a frame that breaks the protocol
}

// item is one frame's worth of a stream's output: a header block or data.
type item struct {
	headers []hpack.HeaderField // nil: data
	data    []byte
	end     bool
	at      time.Time // when it began to wait (pending items only)
}

type outStream struct {
	window  int64
	pending []item
	queued  int // bytes of data in pending
}

// limits of one connection's output
type outLimits struct {
	queueMax   int     // bytes in the peer's write queue beyond this cut it
	queueSoft  int     // DATA is queued only while the queue holds less than this
	pendingMax int     // data waiting for window, all streams (0: no bound of its own)
	budget     *budget // counts that data too (nil: not counted)
	// a stream whose output has waited this long (for the peer's window, or for room in its
	// queue) is reset, and what it held given back (0: it may wait as long as the connection lasts)
	stall time.Duration
}

var (
	clientOut   = outLimits{queueMax: 1 << 20, queueSoft: 256 << 10, pendingMax: maxConnPending}
	upstreamOut = outLimits{queueMax: 64 << 20, queueSoft: 1 << 20} // what it is sent is the clients' requests, counted there
)

type conn struct {
	nc       net.Conn
	fr       *http2.Framer // ReadFrame only from the read loop; writes under wmu
	lim      outLimits
	asClient bool // our role on it (set by handshake, before the read loop starts)
	// stalled, when set, hears (outside wmu) the streams reset for output that waited lim.stall
	stalled func(ids []uint32)

	wmu      sync.Mutex
	w        *peerWriter // the peer's queue (under wmu)
	enc      *hpack.Encoder
	hbuf     bytes.Buffer
	maxFrame uint32
	initWin  int64 // a new stream's window: 0 until the peer's first SETTINGS says what it is
	settled  bool  // the peer's first SETTINGS has come
	connWin  int64
	out      map[uint32]*outStream
	queued   int         // data waiting for window, all streams
	blocked  bool        // data waits for room in the queue
	stallT   *time.Timer // armed while output waits and lim.stall is set

	// receive side, read loop only
	connUnacked uint32
}

func newConn(nc net.Conn, lim outLimits) *conn {
	c := &conn{
		nc:       nc,
		lim:      lim,
		maxFrame: defaultMaxFrame,
		connWin:  defaultWindow,
		out:      map[uint32]*outStream{},
	}
	c.w = newPeerWriter(nc, &c.wmu, lim.queueMax)
	c.w.room = c.roomLocked
	c.fr = http2.NewFramer(c.w, &blockGuard{r: bufio.NewReaderSize(nc, 32<<10)})
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.MaxHeaderListSize = maxHeaderList
	c.fr.SetMaxReadFrameSize(defaultMaxFrame)
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

// handshake starts the writer and queues our preface (client role) and settings; a server first
// reads the client's preface (within the read deadline its owner set).
func (c *conn) handshake(server bool) error {
	c.asClient = !server
	c.w.start()
	if server {
		buf := make([]byte, len(clientPreface))
		_, err := io.ReadFull(c.nc, buf)
		if err != nil || string(buf) != clientPreface {
			return errors.New("not an HTTP/2 client (bad preface)")
		}
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if !server {
		_, _ = c.w.Write([]byte(clientPreface))
	}
	settings := []http2.Setting{
		{ID: http2.SettingInitialWindowSize, Val: recvStreamWindow},
		{ID: http2.SettingMaxHeaderListSize, Val: maxHeaderList},
	}
	if server {
		settings = append(settings, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: maxStreams})
	} else {
		settings = append(settings, http2.Setting{ID: http2.SettingEnablePush, Val: 0})
	}
	_ = c.fr.WriteSettings(settings...)
	_ = c.fr.WriteWindowUpdate(0, recvConnWindow-defaultWindow)
	return c.flushLocked()
}

// flushLocked hands what was queued to the peer's writer; an error if the peer is gone, or its
// queue is past its bound (it is then cut). Called with wmu held.
func (c *conn) flushLocked() error { return c.w.kick() }

func (c *conn) dead() bool { return c.w.stoppedLocked() }

// cut ends the connection without writing more.
func (c *conn) cut() {
	c.wmu.Lock()
	c.w.cutLocked()
	c.wmu.Unlock()
}

// open registers a stream for sending, with the peer's initial window. Called with wmu held.
func (c *conn) openLocked(id uint32) {
	c.out[id] = &outStream{window: c.initWin}
}

// forget drops a stream's send state (its frames still waiting are dropped with it).
func (c *conn) forget(id uint32) {
	c.wmu.Lock()
	c.dropLocked(id)
	c.wmu.Unlock()
}

func (c *conn) dropLocked(id uint32) {
	if s := c.out[id]; s != nil {
		c.unpend(s, s.queued)
		delete(c.out, id)
	}
}

// pend holds n more bytes of s's data until the windows allow them; false if that passes a bound.
func (c *conn) pend(s *outStream, n int) bool {
	if s.queued+n > maxPendingBytes || c.lim.pendingMax > 0 && c.queued+n > c.lim.pendingMax || !c.lim.budget.take(n) {
		return false
	}
	s.queued += n
	c.queued += n
	return true
}

func (c *conn) unpend(s *outStream, n int) {
	s.queued -= n
	c.queued -= n
	c.lim.budget.give(n)
}

// send queues a stream's items in order, as far as the peer's windows and queue allow; the rest
// waits for its WINDOW_UPDATE or for room. False: the stream is gone, or its peer stopped
// reading (the stream is then reset), or the peer is gone.
func (c *conn) send(id uint32, items ...item) bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	ok := c.sendLocked(id, items...)
	if c.flushLocked() != nil {
		return false
	}
	return ok
}

func (c *conn) sendLocked(id uint32, items ...item) bool {
	s := c.out[id]
	if s == nil || c.dead() {
		return false
	}
	for _, it := range items {
		if len(s.pending) == 0 {
			rest, done := c.writeItem(id, s, it)
			if done {
				continue
			}
			it = rest
		}
		if !c.pend(s, len(it.data)) {
			_ = c.fr.WriteRSTStream(id, http2.ErrCodeEnhanceYourCalm)
			c.dropLocked(id)
			return false
		}
		it.at = time.Now()
		s.pending = append(s.pending, it)
		c.armStallLocked(c.lim.stall)
	}
	if len(s.pending) == 0 && len(items) > 0 && items[len(items)-1].end {
		delete(c.out, id) // everything of ours on this stream has been sent
	}
	return true
}

// writeItem queues what the windows and the queue allow of it; returns what is left and whether
// it all went.
func (c *conn) writeItem(id uint32, s *outStream, it item) (item, bool) {
	if it.headers != nil {
		c.writeHeaders(id, it.headers, it.end)
		return item{}, true
	}
	data := it.data
	for len(data) > 0 {
		room := int64(c.lim.queueSoft - c.w.queuedLocked())
		if room <= 0 {
			c.blocked = true
			return item{data: data, end: it.end}, false
		}
		n := min(int64(len(data)), int64(c.maxFrame), c.connWin, s.window, room)
		if n <= 0 {
			return item{data: data, end: it.end}, false
		}
		last := int(n) == len(data)
		_ = c.fr.WriteData(id, last && it.end, data[:n])
		c.connWin -= n
		s.window -= n
		data = data[n:]
	}
	if len(it.data) == 0 && it.end {
		_ = c.fr.WriteData(id, true, nil)
	}
	return item{}, true
}

func (c *conn) writeHeaders(id uint32, fields []hpack.HeaderField, end bool) {
	c.hbuf.Reset()
	for _, f := range fields {
		_ = c.enc.WriteField(f)
	}
	block := c.hbuf.Bytes()
	first := true
	for first || len(block) > 0 {
		n := min(len(block), int(c.maxFrame)) // maxFrame is at least 16384 (control checks it)
		chunk, rest := block[:n], block[n:]
		if first {
			_ = c.fr.WriteHeaders(http2.HeadersFrameParam{
				StreamID: id, BlockFragment: chunk, EndStream: end, EndHeaders: len(rest) == 0,
			})
		} else {
			_ = c.fr.WriteContinuation(id, len(rest) == 0, chunk)
		}
		first = false
		block = rest
	}
}

// roomLocked: the writer has written what it had; data that waited for room goes now.
func (c *conn) roomLocked() {
	if c.blocked {
		c.blocked = false
		c.drainLocked()
		_ = c.flushLocked()
	}
}

// drainLocked queues what waits on every stream as far as the windows and the queue allow.
func (c *conn) drainLocked() {
	for id, s := range c.out {
		for len(s.pending) > 0 {
			rest, done := c.writeItem(id, s, s.pending[0])
			if !done {
				c.unpend(s, len(s.pending[0].data)-len(rest.data))
				rest.at = s.pending[0].at // it has waited since its first byte did
				s.pending[0] = rest
				break
			}
			c.unpend(s, len(s.pending[0].data))
			end := s.pending[0].end
			s.pending = s.pending[1:]
			if end && len(s.pending) == 0 {
				delete(c.out, id)
			}
		}
		if c.blocked {
			return
		}
	}
}

// armStallLocked makes sure the stall check runs within d while output waits (wmu held).
func (c *conn) armStallLocked(d time.Duration) {
	if c.lim.stall <= 0 || c.stallT != nil {
		return
	}
	c.stallT = time.AfterFunc(d, c.checkStalls)
}

// checkStalls resets each stream whose output has waited lim.stall or longer: RST_STREAM CANCEL
// (the peer broke no rule: withholding window is its right, but the front does not hold a reply
// for it without end), and what the stream held is given back to the budget at once.
func (c *conn) checkStalls() {
	c.wmu.Lock()
	c.stallT = nil
	if c.dead() {
		c.wmu.Unlock()
		return
	}
	now := time.Now()
	var ids []uint32
	var next time.Time
	for id, s := range c.out {
		if len(s.pending) == 0 {
			continue
		}
		if since := s.pending[0].at; now.Sub(since) >= c.lim.stall {
			ids = append(ids, id)
		} else if next.IsZero() || since.Before(next) {
			next = since
		}
	}
	for _, id := range ids {
		_ = c.fr.WriteRSTStream(id, http2.ErrCodeCancel)
		c.dropLocked(id)
	}
	if !next.IsZero() {
		c.armStallLocked(next.Add(c.lim.stall).Sub(now))
	}
	if len(ids) > 0 {
		_ = c.flushLocked()
	}
	c.wmu.Unlock()
	if len(ids) > 0 && c.stalled != nil {
		c.stalled(ids)
	}
}

// stopTimersLocked: the connection is ending (wmu held).
func (c *conn) stopTimersLocked() {
	if c.stallT != nil {
		c.stallT.Stop()
		c.stallT = nil
	}
}

// checkSetting holds a peer's setting to RFC 9113 6.5.2; fromServer: the peer is the server
// (we are its client).
func checkSetting(s http2.Setting, fromServer bool) error {
	switch s.ID {
	case http2.SettingEnablePush, http2.SettingEnableConnectProtocol, http2.SettingNoRFC7540Priorities:
		if s.ID == http2.SettingEnablePush && fromServer && s.Val != 0 { // a client MUST treat it so
			return connErr{http2.ErrCodeProtocol, fmt.Sprintf("SETTINGS %v %d from a server (0 only)", s.ID, s.Val)}
		}
		if s.Val > 1 {
			return connErr{http2.ErrCodeProtocol, fmt.Sprintf("SETTINGS %v %d (0 or 1)", s.ID, s.Val)}
		}
	case http2.SettingInitialWindowSize:
		if s.Val > maxWindow {
			return connErr{http2.ErrCodeFlowControl, fmt.Sprintf("SETTINGS %v %d", s.ID, s.Val)}
		}
	case http2.SettingMaxFrameSize:
		if s.Val < defaultMaxFrame || s.Val > maxFrameLimit {
			return connErr{http2.ErrCodeProtocol, fmt.Sprintf("SETTINGS %v %d", s.ID, s.Val)}
		}
	}
	return nil
}

// control handles the frames that concern the connection itself; false: not one of those. Its
// error is a connErr, or an http2.StreamError for a stream's window beyond its maximum.
func (c *conn) control(f http2.Frame) (bool, error) {
	switch f := f.(type) {
	case *http2.SettingsFrame:
		if f.IsAck() {
			return true, nil
		}
		if err := f.ForeachSetting(func(s http2.Setting) error { return checkSetting(s, c.asClient) }); err != nil {
			return true, err
		}
		c.wmu.Lock()
		defer c.wmu.Unlock()
		initial := c.initWin
		if !c.settled { // the peer's first: until it came, its streams' windows were unknown (0 here)
			c.settled = true
			initial = defaultWindow
		}
		_ = f.ForeachSetting(func(s http2.Setting) error {
			switch s.ID {
			case http2.SettingInitialWindowSize:
				initial = int64(s.Val)
			case http2.SettingMaxFrameSize:
				c.maxFrame = s.Val
			case http2.SettingHeaderTableSize:
				c.enc.SetMaxDynamicTableSizeLimit(s.Val)
			}
			return nil
		})
		for _, o := range c.out {
			o.window += initial - c.initWin
			if o.window > maxWindow {
				return true, connErr{http2.ErrCodeFlowControl, "INITIAL_WINDOW_SIZE takes a stream's window beyond 2^31-1"}
			}
		}
		c.initWin = initial
		_ = c.fr.WriteSettingsAck()
		c.drainLocked()
		return true, c.flushLocked()
	case *http2.WindowUpdateFrame:
		c.wmu.Lock()
		defer c.wmu.Unlock()
		inc := int64(f.Increment)
		if f.StreamID == 0 {
			if c.connWin+inc > maxWindow {
				return true, connErr{http2.ErrCodeFlowControl, "WINDOW_UPDATE takes the connection's window beyond 2^31-1"}
			}
			c.connWin += inc
		} else if s := c.out[f.StreamID]; s != nil {
			if s.window+inc > maxWindow {
				c.dropLocked(f.StreamID)
				return true, http2.StreamError{StreamID: f.StreamID, Code: http2.ErrCodeFlowControl}
			}
			s.window += inc
		}
		c.drainLocked()
		return true, c.flushLocked()
	case *http2.PingFrame:
		if f.IsAck() {
			return true, nil
		}
		c.wmu.Lock()
		defer c.wmu.Unlock()
		_ = c.fr.WritePing(true, f.Data)
		return true, c.flushLocked()
	case *http2.PriorityFrame:
		return true, nil
	}
	return false, nil
}

// received accounts n bytes of DATA on a stream and refills the windows once half is used (at
// once: the front's bounds on what it holds are the request and budget bounds, not the windows).
// streamUnacked belongs to the stream's owner; nil: the stream is gone (the connection only).
func (c *conn) received(id uint32, n uint32, streamUnacked *uint32) {
	if n == 0 {
		return
	}
	var conn, stream uint32
	c.connUnacked += n
	if c.connUnacked >= recvConnWindow/2 {
		conn, c.connUnacked = c.connUnacked, 0
	}
	if streamUnacked != nil {
		*streamUnacked += n
		if *streamUnacked >= recvStreamWindow/2 {
			stream, *streamUnacked = *streamUnacked, 0
		}
	}
	if conn == 0 && stream == 0 {
		return
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if conn > 0 {
		_ = c.fr.WriteWindowUpdate(0, conn)
	}
	if stream > 0 {
		_ = c.fr.WriteWindowUpdate(id, stream)
	}
	_ = c.flushLocked()
}

// reset ends a stream with RST_STREAM.
func (c *conn) reset(id uint32, code http2.ErrCode) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.dropLocked(id)
	if c.dead() {
		return
	}
	_ = c.fr.WriteRSTStream(id, code)
	_ = c.flushLocked()
}

// goAway queues a GOAWAY (the connection is then closed by its owner).
func (c *conn) goAway(last uint32, code http2.ErrCode) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.dead() {
		return
	}
	_ = c.fr.WriteGoAway(last, code, nil)
	_ = c.flushLocked()
}
