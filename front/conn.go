package main

// One HTTP/2 connection, in either role: the framer, the write side (one lock, one HPACK encoder,
// the peer's flow-control windows, frames that wait for window), and receive-side window refills.
// Frames are read by one goroutine per connection (its owner's read loop); everything written
// goes through send, under the write lock, and is flushed at once so that one call's frames
// leave in one write.

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
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
	defaultMaxFrame  = 16384
	maxHeaderList    = 64 << 10  // a header block larger than this ends the connection
	maxPendingBytes  = 32 << 20  // a stream whose peer stops reading is reset beyond this
	maxConnPending   = 256 << 20 // and any stream that would take a connection's waiting bytes beyond this
	handshakeTimeout = 5 * time.Second
)

// a peer that takes no bytes for this long loses its connection: whoever writes to it (the read
// loop of another connection, say) is never held longer
var writeTimeout atomic.Int64 // nanoseconds (tests shorten it)

func init() { writeTimeout.Store(int64(5 * time.Second)) }

var errConnClosed = errors.New("connection closed")

// item is one frame's worth of a stream's output: a header block or data.
type item struct {
	headers []hpack.HeaderField // nil: data
	data    []byte
	end     bool
}

type outStream struct {
	window  int64
	pending []item
	queued  int // bytes of data in pending
}

type conn struct {
	nc net.Conn
	fr *http2.Framer // ReadFrame only from the read loop; writes under wmu

	wmu      sync.Mutex
	bw       *bufio.Writer
	enc      *hpack.Encoder
	hbuf     bytes.Buffer
	maxFrame uint32
	initWin  int64 // a new stream's window: 0 until the peer's first SETTINGS says what it is
	settled  bool  // the peer's first SETTINGS has come
	connWin  int64
	out      map[uint32]*outStream
	queued   int // data waiting for window, all streams
	dead     bool

	// receive side, read loop only
	connUnacked uint32

	closed    chan struct{}
	closeOnce sync.Once
}

func newConn(nc net.Conn) *conn {
	c := &conn{
		nc:       nc,
		bw:       bufio.NewWriterSize(nc, 32<<10),
		maxFrame: defaultMaxFrame,
		connWin:  defaultWindow,
		out:      map[uint32]*outStream{},
		closed:   make(chan struct{}),
	}
	c.fr = http2.NewFramer(c.bw, bufio.NewReaderSize(nc, 32<<10))
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.MaxHeaderListSize = maxHeaderList
	c.fr.SetMaxReadFrameSize(defaultMaxFrame)
	c.enc = hpack.NewEncoder(&c.hbuf)
	return c
}

// handshake sends our preface (client role) and settings; a server first reads the client's preface.
func (c *conn) handshake(server bool) error {
	_ = c.nc.SetDeadline(time.Now().Add(handshakeTimeout))
	defer func() { _ = c.nc.SetDeadline(time.Time{}) }()
	if server {
		buf := make([]byte, len(clientPreface))
		if _, err := io.ReadFull(c.nc, buf); err != nil || string(buf) != clientPreface {
			return errors.New("not an HTTP/2 client (bad preface)")
		}
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if !server {
		if _, err := c.bw.WriteString(clientPreface); err != nil {
			return err
		}
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
	if err := c.fr.WriteSettings(settings...); err != nil {
		return err
	}
	if err := c.fr.WriteWindowUpdate(0, recvConnWindow-defaultWindow); err != nil {
		return err
	}
	return c.bw.Flush()
}

// flushLocked writes what is buffered, within writeTimeout; a peer that does not take it in time
// is cut off (its read loop then ends the connection). Called with wmu held.
func (c *conn) flushLocked() error {
	if c.dead {
		return errConnClosed
	}
	_ = c.nc.SetWriteDeadline(time.Now().Add(time.Duration(writeTimeout.Load())))
	err := c.bw.Flush()
	if err != nil {
		c.dead = true
		_ = c.nc.Close()
	}
	return err
}

func (c *conn) close() {
	c.closeOnce.Do(func() {
		c.wmu.Lock()
		c.dead = true
		c.wmu.Unlock()
		_ = c.nc.Close()
		close(c.closed)
	})
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
		c.queued -= s.queued
		delete(c.out, id)
	}
}

// send writes a stream's items in order, as far as the peer's windows allow; the rest waits for
// its WINDOW_UPDATE. False: the stream is gone, or its peer stopped reading (it is then reset).
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
	if s == nil || c.dead {
		return false
	}
	for _, it := range items {
		if len(s.pending) > 0 {
			s.pending = append(s.pending, it)
			s.queued += len(it.data)
			c.queued += len(it.data)
			continue
		}
		if rest, done := c.writeItem(id, s, it); !done {
			s.pending = append(s.pending, rest)
			s.queued += len(rest.data)
			c.queued += len(rest.data)
		}
	}
	if s.queued > maxPendingBytes || c.queued > maxConnPending {
		_ = c.fr.WriteRSTStream(id, http2.ErrCodeEnhanceYourCalm)
		c.queued -= s.queued
		delete(c.out, id)
		return false
	}
	if len(s.pending) == 0 && len(items) > 0 && items[len(items)-1].end {
		delete(c.out, id) // everything of ours on this stream has been sent
	}
	return true
}

// writeItem writes what the windows allow of it; returns what is left and whether it all went.
func (c *conn) writeItem(id uint32, s *outStream, it item) (item, bool) {
	if it.headers != nil {
		c.writeHeaders(id, it.headers, it.end)
		return item{}, true
	}
	data := it.data
	for len(data) > 0 {
		n := int64(len(data))
		if n > int64(c.maxFrame) {
			n = int64(c.maxFrame)
		}
		if n > c.connWin {
			n = c.connWin
		}
		if n > s.window {
			n = s.window
		}
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
		n := len(block)
		if n > int(c.maxFrame) {
			n = int(c.maxFrame)
		}
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

// drainLocked sends what waits on every stream the windows now allow.
func (c *conn) drainLocked() {
	for id, s := range c.out {
		for len(s.pending) > 0 {
			rest, done := c.writeItem(id, s, s.pending[0])
			if !done {
				sent := len(s.pending[0].data) - len(rest.data)
				s.queued -= sent
				c.queued -= sent
				s.pending[0] = rest
				break
			}
			s.queued -= len(s.pending[0].data)
			c.queued -= len(s.pending[0].data)
			end := s.pending[0].end
			s.pending = s.pending[1:]
			if end && len(s.pending) == 0 {
				delete(c.out, id)
			}
		}
	}
}

// control handles the frames that concern the connection itself; false: not one of those.
func (c *conn) control(f http2.Frame) (bool, error) {
	switch f := f.(type) {
	case *http2.SettingsFrame:
		if f.IsAck() {
			return true, nil
		}
		c.wmu.Lock()
		defer c.wmu.Unlock()
		initial := c.initWin
		if !c.settled { // the peer's first: until it came, its streams' windows were unknown (0 here)
			c.settled = true
			initial = defaultWindow
		}
		err := f.ForeachSetting(func(s http2.Setting) error {
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
		if err != nil {
			return true, err
		}
		for _, o := range c.out {
			o.window += initial - c.initWin
		}
		c.initWin = initial
		_ = c.fr.WriteSettingsAck()
		c.drainLocked()
		return true, c.flushLocked()
	case *http2.WindowUpdateFrame:
		c.wmu.Lock()
		defer c.wmu.Unlock()
		if f.StreamID == 0 {
			c.connWin += int64(f.Increment)
		} else if s := c.out[f.StreamID]; s != nil {
			s.window += int64(f.Increment)
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

// received accounts n bytes of DATA on a stream and refills the windows once half is used.
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
	if c.dead {
		return
	}
	_ = c.fr.WriteRSTStream(id, code)
	_ = c.flushLocked()
}
