package main

// One peer's output, isolated from every other peer's: whoever has something for the peer queues
// the bytes (under its owner's lock, never waiting on the socket) and the peer's own goroutine
// writes them. A peer that takes no bytes for writeTimeout, or whose queue passes its bound, is
// cut: its socket is closed and its owner's read loop ends. No loop shared between peers (the
// shim's, the downstream's, a client's, the list channel's) ever waits on another peer's socket.

import (
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// a peer that takes no bytes for this long loses its connection
var writeTimeout atomic.Int64 // nanoseconds (tests change it)

func init() { writeTimeout.Store(int64(5 * time.Second)) }

var errConnClosed = errors.New("connection closed")

const writeChunk = 64 << 10 // written at once, at most

type peerWriter struct {
	nc  net.Conn
	max int         // bytes queued beyond this cut the peer
	mu  *sync.Mutex // the owner's: held by whoever queues, and around the fields below
	// room, when set, is called (with mu held) each time the goroutine has written what it had:
	// its owner may queue what it held back
	room func()

	cond     sync.Cond
	buf      []byte // queued, not yet taken by the goroutine
	spare    []byte
	inflight int         // taken, being written
	closing  bool        // write what is queued, then close
	cut      bool        // close without writing more
	halt     atomic.Bool // cut, for the goroutine while it writes
	closeBy  time.Time

	onDone func() // after the socket is closed (set before start)
	done   chan struct{}
}

func newPeerWriter(nc net.Conn, mu *sync.Mutex, max int) *peerWriter {
	w := &peerWriter{nc: nc, mu: mu, max: max, done: make(chan struct{})}
	w.cond.L = mu
	return w
}

func (w *peerWriter) start() { go w.loop() }

// Write queues p (mu held); it never fails: an overflow is found by kick.
func (w *peerWriter) Write(p []byte) (int, error) {
	if !w.stoppedLocked() {
		w.buf = append(w.buf, p...)
	}
	return len(p), nil
}

// queuedLocked is what waits to be written, the part being written included.
func (w *peerWriter) queuedLocked() int { return len(w.buf) + w.inflight }

func (w *peerWriter) stoppedLocked() bool { return w.closing || w.cut }

// kick wakes the goroutine for what was queued (mu held); errConnClosed if the peer is gone or
// was cut now, its queue past its bound.
func (w *peerWriter) kick() error {
	if w.stoppedLocked() {
		return errConnClosed
	}
	if w.queuedLocked() > w.max {
		w.cutLocked()
		return errConnClosed
	}
	if len(w.buf) > 0 {
		w.cond.Signal()
	}
	return nil
}

// cutLocked drops what is queued and ends the connection both ways (mu held).
func (w *peerWriter) cutLocked() {
	w.cut = true
	w.halt.Store(true)
	w.buf = nil
	_ = w.nc.Close() // a write or read under way returns now
	w.cond.Broadcast()
}

// closeLocked writes what is queued (for writeTimeout at most), then closes; the owner's read
// loop ends at once (mu held).
func (w *peerWriter) closeLocked() {
	if w.stoppedLocked() {
		return
	}
	w.closing = true
	w.closeBy = time.Now().Add(time.Duration(writeTimeout.Load()))
	_ = w.nc.SetReadDeadline(time.Unix(1, 0))
	w.cond.Broadcast()
}

func (w *peerWriter) loop() {
	defer func() {
		_ = w.nc.Close()
		close(w.done)
		if w.onDone != nil {
			w.onDone()
		}
	}()
	w.mu.Lock()
	defer w.mu.Unlock()
	for {
		for len(w.buf) == 0 && !w.stoppedLocked() {
			w.cond.Wait()
		}
		if w.cut || len(w.buf) == 0 {
			return
		}
		out := w.buf
		w.buf, w.spare = w.spare[:0], nil
		w.inflight = len(out)
		closeBy := w.closeBy
		w.mu.Unlock()
		err := w.writeAll(out, closeBy)
		w.mu.Lock()
		w.inflight = 0
		if cap(out) <= 4*writeChunk {
			w.spare = out[:0]
		}
		if err != nil {
			w.cutLocked()
			return
		}
		if w.room != nil && !w.stoppedLocked() {
			w.room()
		}
	}
}

// writeAll writes out; it fails once the peer has taken no bytes for writeTimeout (or, closing,
// at closeBy).
func (w *peerWriter) writeAll(out []byte, closeBy time.Time) error {
	for len(out) > 0 {
		if w.halt.Load() {
			return errConnClosed
		}
		chunk := out
		if len(chunk) > writeChunk {
			chunk = chunk[:writeChunk]
		}
		deadline := time.Now().Add(time.Duration(writeTimeout.Load()))
		if !closeBy.IsZero() && closeBy.Before(deadline) {
			deadline = closeBy
		}
		_ = w.nc.SetWriteDeadline(deadline)
		n, err := w.nc.Write(chunk)
		out = out[n:]
		if err != nil {
			var ne net.Error
			if n > 0 && errors.As(err, &ne) && ne.Timeout() && (closeBy.IsZero() || time.Now().Before(closeBy)) {
				continue // slow, but it took bytes: a new deadline for the rest
			}
			return err
		}
	}
	return nil
}
