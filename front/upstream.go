package main

// The front's connections to the shim and to the downstream runtime (HTTP/2 client role): one
// connection each, dialled when first needed and again after it fails, many calls at once on it.
// A call's reply goes to its sink frame by frame, from the connection's read loop.

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

	mu  sync.Mutex
	cur *upConn
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
	id      uint32
	uc      *upConn
	sink    sink
	unacked uint32
	once    sync.Once
}

// conn is the live connection, dialled if there is none.
func (u *upstream) connection() (*upConn, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.cur != nil && u.cur.usable() {
		return u.cur, nil
	}
	nc, err := net.DialTimeout("unix", u.addr, dialTimeout)
	if err != nil {
		return nil, err
	}
	uc := &upConn{conn: newConn(nc), up: u, nextID: 1, calls: map[uint32]*call{}}
	if err := uc.handshake(false); err != nil {
		_ = nc.Close()
		return nil, err
	}
	u.cur = uc
	go uc.readLoop()
	return uc, nil
}

func (uc *upConn) usable() bool {
	uc.mu.Lock()
	defer uc.mu.Unlock()
	return uc.err == nil && !uc.goingAw && uc.nextID < 1<<30
}

// start sends a request (headers and the whole body) on a new stream; its reply goes to s.
func (u *upstream) start(hdrs []hpack.HeaderField, body []byte, s sink) (*call, error) {
	uc, err := u.connection()
	if err != nil {
		return nil, err
	}
	uc.wmu.Lock() // stream ids must reach the peer in the order they are taken
	uc.mu.Lock()
	if uc.err != nil || uc.goingAw {
		uc.mu.Unlock()
		uc.wmu.Unlock()
		return nil, errors.New("connection closing")
	}
	c := &call{id: uc.nextID, uc: uc, sink: s}
	uc.nextID += 2
	uc.calls[c.id] = c
	uc.mu.Unlock()
	uc.openLocked(c.id)
	uc.sendLocked(c.id, item{headers: hdrs, end: len(body) == 0})
	if len(body) > 0 {
		uc.sendLocked(c.id, item{data: body, end: true})
	}
	err = uc.bw.Flush()
	uc.wmu.Unlock()
	if err != nil {
		uc.fail(err)
		return nil, err
	}
	return c, nil
}

// cancel gives up a call: the peer is told (RST_STREAM CANCEL) and the sink hears nothing more.
func (c *call) cancel() {
	c.once.Do(func() {
		c.uc.mu.Lock()
		delete(c.uc.calls, c.id)
		c.uc.mu.Unlock()
		c.uc.reset(c.id, http2.ErrCodeCancel)
	})
}

// finish removes a call whose reply is complete, or that failed, and tells its sink the failure.
func (c *call) finish(err error) {
	c.once.Do(func() {
		c.uc.mu.Lock()
		delete(c.uc.calls, c.id)
		c.uc.mu.Unlock()
		c.uc.forget(c.id)
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
	uc.close()
	for _, c := range calls {
		c.finish(err)
	}
}

func (uc *upConn) readLoop() {
	for {
		f, err := uc.fr.ReadFrame()
		if err != nil {
			uc.fail(fmt.Errorf("connection lost: %v", err))
			return
		}
		if handled, err := uc.control(f); handled {
			if err != nil {
				uc.fail(err)
				return
			}
			continue
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			c := uc.lookup(f.StreamID)
			if c == nil {
				continue
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
				continue
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
	}
}
