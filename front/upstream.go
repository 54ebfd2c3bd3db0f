package main

// The front's connections to the shim and to the downstream runtime (HTTP/2 client role): one
// connection each, dialled when first needed and again after it fails, many calls at once on it.
// A call's reply goes to its sink frame by frame, from the connection's read loop; a reply that
// breaks the protocol (a header list past maxHeaderList, DATA past its window) fails its call.

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

const dialTimeout = time.Second

// sink receives one call's reply: header blocks (the first is the reply's headers, a later one
// its trailers; end marks the last frame), data (only valid during the call), or a failure of
// the transport, once.
type sink interface {
	headers(fields []hpack.HeaderField, end bool)
	data(p []byte, end bool)
	failed(err error)
}

type upstream struct {
	name string // for messages: what the caller knows it by
	addr string // its unix socket

	mu   sync.Mutex // cur
	cur  *upConn
	dial sync.Mutex // one dial at a time
}

type upConn struct {
	*conn
	up *upstream

	mu      sync.Mutex // calls and nextID; taken inside wmu where both are needed
	nextID  uint32
	calls   map[uint32]*call
	goingAw bool
	err     error
}

type call struct {
	sink    sink
	unacked uint32 // the connection's read loop only
	once    sync.Once

	mu        sync.Mutex
	uc        *upConn // nil until the call is on a connection
	id        uint32
	cancelled bool
}

// live is the connection if there is a usable one (never dials).
func (u *upstream) live() *upConn {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.cur != nil && u.cur.usable() {
		return u.cur
	}
	return nil
}

// connection is the live connection, dialled if there is none (one dial at a time).
func (u *upstream) connection() (*upConn, error) {
	u.dial.Lock()
	defer u.dial.Unlock()
	if uc := u.live(); uc != nil {
		return uc, nil
	}
	nc, err := net.DialTimeout("unix", u.addr, dialTimeout)
	if err != nil {
		return nil, err
	}
	uc := &upConn{conn: newConn(nc, upstreamOut), up: u, nextID: 1, calls: map[uint32]*call{}}
	if err := uc.handshake(false); err != nil {
		uc.cut()
		return nil, err
	}
	u.mu.Lock()
	u.cur = uc
	u.mu.Unlock()
	go uc.readLoop()
	return uc, nil
}

func (uc *upConn) usable() bool {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	return uc.err == nil && !uc.goingAw && uc.nextID < 1<<30
}

// start sends a request (headers and the whole body) on a new stream; its reply, or the failure
// to send it, goes to s. It never waits: a connection that must be dialled first is dialled
// by a goroutine of its own, so a caller's read loop is never held by a peer that does not accept.
func (u *upstream) start(hdrs []hpack.HeaderField, body []byte, s sink) *call {
	c := &call{sink: s}
	if uc := u.live(); uc != nil && uc.open(c, hdrs, body) == nil {
		return c
	}
	go func() {
		uc, err := u.connection()
		if err == nil {
			err = uc.open(c, hdrs, body)
		}
		if err != nil {
			c.finish(err)
		}
	}()
	return c
}

// open puts the call on the connection: a stream id (in the order the peer must see them), its
// headers and body. A call cancelled meanwhile is not sent.
func (uc *upConn) open(c *call, hdrs []hpack.HeaderField, body []byte) error {
	uc.wmu.Lock()
	defer uc.wmu.Unlock()
	uc.mu.Lock()
	if uc.err != nil || uc.goingAw {
		uc.mu.Unlock()
		return errors.New("connection closing")
	}
	c.mu.Lock()
	if c.cancelled {
		c.mu.Unlock()
		uc.mu.Unlock()
		return nil
	}
	c.uc, c.id = uc, uc.nextID
	c.mu.Unlock()
	uc.nextID += 2
	uc.calls[c.id] = c
	uc.mu.Unlock()
	uc.openLocked(c.id)
	ok := uc.sendLocked(c.id, item{headers: hdrs, end: len(body) == 0})
	if ok && len(body) > 0 {
		ok = uc.sendLocked(c.id, item{data: body, end: true})
	}
	if err := uc.flushLocked(); err != nil {
		go uc.fail(err) // takes wmu, held here
	} else if !ok {
		go c.finish(errors.New("the request could not be queued"))
	}
	return nil
}

// placed is the call's connection and stream id (nil before it is on one).
func (c *call) placed() (*upConn, uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.uc, c.id
}

// cancel gives up a call: the peer is told (RST_STREAM CANCEL) and the sink hears nothing more
// (but a sink that holds bytes, a collector, lets them go).
func (c *call) cancel() {
	c.once.Do(func() {
		c.mu.Lock()
		c.cancelled = true
		c.mu.Unlock()
		if r, ok := c.sink.(interface{ release() }); ok {
			r.release()
		}
		uc, id := c.placed()
		if uc == nil {
			return
		}
		uc.mu.Lock()
		delete(uc.calls, id)
		uc.mu.Unlock()
		uc.reset(id, http2.ErrCodeCancel)
	})
}

// finish removes a call whose reply is complete, or that failed, and tells its sink the failure.
func (c *call) finish(err error) {
	c.once.Do(func() {
		if uc, id := c.placed(); uc != nil {
			uc.mu.Lock()
			delete(uc.calls, id)
			uc.mu.Unlock()
			uc.forget(id)
		}
		if err != nil {
			c.sink.failed(err)
		}
	})
}

func (uc *upConn) lookup(id uint32) *call {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	return uc.calls[id]
}

// abort ends a call the peer got wrong: the peer is told (RST_STREAM), the sink hears err.
func (c *call) abort(code http2.ErrCode, err error) {
	if uc, id := c.placed(); uc != nil {
		uc.reset(id, code)
	}
	c.finish(err)
}

// fail ends the connection and every call on it.
func (uc *upConn) fail(err error) {
	uc.mu.Lock()
	if uc.err == nil {
		uc.err = err
	}
	calls := make([]*call, 0, len(uc.calls))
	for _, c := range uc.calls {
		calls = append(calls, c)
	}
	uc.mu.Unlock()
	uc.wmu.Lock()
	for id := range uc.out {
		uc.dropLocked(id)
	}
	uc.w.closeLocked() // what is queued (a GOAWAY) still goes
	uc.wmu.Unlock()
	for _, c := range calls {
		c.finish(err)
	}
}

func (uc *upConn) readLoop() {
	for {
		f, err := uc.fr.ReadFrame()
		if err == nil {
			var handled bool
			if handled, err = uc.control(f); !handled {
				err = uc.frame(f)
			}
		}
		var se http2.StreamError
		if errors.As(err, &se) { // one call's fault
			if c := uc.lookup(se.StreamID); c != nil {
				c.abort(se.Code, fmt.Errorf("%s broke the protocol on its stream (%v)", uc.up.name, se.Code))
			} else {
				uc.reset(se.StreamID, se.Code)
			}
			continue
		}
		if err != nil {
			if code, ok := goAwayCode(err); ok {
				uc.goAway(0, code)
			}
			uc.fail(fmt.Errorf("connection lost: %v", err))
			return
		}
	}
}

func (uc *upConn) frame(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.MetaHeadersFrame:
		c := uc.lookup(f.StreamID)
		if c == nil {
			return nil
		}
		if f.Truncated { // never passed on cut short
			c.abort(http2.ErrCodeCancel, errTooLarge{fmt.Sprintf("%s sent a header list larger than %d bytes", uc.up.name, maxHeaderList)})
			return nil
		}
		end := f.StreamEnded()
		c.sink.headers(f.Fields, end)
		if end {
			c.finish(nil)
		}
	case *http2.DataFrame:
		c := uc.lookup(f.StreamID)
		n := uint32(f.Length)
		if c == nil {
			uc.received(f.StreamID, n, nil)
			return nil
		}
		uc.received(f.StreamID, n, &c.unacked)
		end := f.StreamEnded()
		if len(f.Data()) > 0 || end {
			c.sink.data(f.Data(), end) // valid until the next frame is read: a sink that keeps it copies it
		}
		if end {
			c.finish(nil)
		}
	case *http2.RSTStreamFrame:
		if c := uc.lookup(f.StreamID); c != nil {
			c.finish(fmt.Errorf("stream reset by %s (%v)", uc.up.name, f.ErrCode))
		}
	case *http2.GoAwayFrame:
		uc.mu.Lock()
		uc.goingAw = true
		var lost []*call
		for id, c := range uc.calls {
			if id > f.LastStreamID {
				lost = append(lost, c)
			}
		}
		uc.mu.Unlock()
		for _, c := range lost {
			c.finish(fmt.Errorf("%s is going away (%v)", uc.up.name, f.ErrCode))
		}
	}
	return nil
}
