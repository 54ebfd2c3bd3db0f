package main

// What the front holds for all its clients at once: connections (a cap; one more is refused with
// a GOAWAY) and bytes (one budget: requests being read and served, replies collected whole, and
// replies waiting for a client's window). Per connection, the bounds of server.go and conn.go
// apply as well, so that no one connection takes the whole budget, and time bounds how long a
// connection may hold what it holds: a reply waits for its client's window windowTimeout at
// most, a connection stays idle idleTimeout at most, and its handshake takes handshakeTimeout.

import (
	"bytes"
	"net"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
)

const (
	defaultMaxConns    = 256
	defaultMaxBuffered = 256 << 20
	// a reply that waits this long for a client's window is reset (RST_STREAM CANCEL)
	defaultWindowTimeout = 10 * time.Second
	// a connection with no open stream and no frame from its client this long gets GOAWAY NO_ERROR
	defaultIdleTimeout = 5 * time.Minute
	// a connection whose preface and first SETTINGS have not come within this is closed
	defaultHandshakeTimeout = 10 * time.Second
)

// budget is a count of bytes held against a maximum, shared by every connection.
type budget struct {
	max  int64
	used atomic.Int64
}

func newBudget(max int64) *budget { return &budget{max: max} }

// take counts n more bytes held; false (and nothing counted) if that would pass the maximum.
func (b *budget) take(n int) bool {
	if b == nil || n <= 0 {
		return true
	}
	if b.used.Add(int64(n)) > b.max {
		b.used.Add(-int64(n))
		return false
	}
	return true
}

// give returns n bytes taken before.
func (b *budget) give(n int) {
	if b != nil && n > 0 {
		b.used.Add(-int64(n))
	}
}

// refuse tells a connection beyond the cap to go away (its server preface, then GOAWAY
// ENHANCE_YOUR_CALM) without reading it, and closes it. It waits on nothing: a socket just
// accepted takes a few bytes at once, or does without them.
func refuse(nc net.Conn) {
	var b bytes.Buffer
	fr := http2.NewFramer(&b, nil)
	_ = fr.WriteSettings()
	_ = fr.WriteGoAway(0, http2.ErrCodeEnhanceYourCalm, []byte("too many connections"))
	_ = nc.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
	_, _ = nc.Write(b.Bytes())
	_ = nc.Close()
}
