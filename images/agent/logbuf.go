package main

// Container logs kept in the guest: each container's CRI-formatted output waits in a bounded
// buffer until the host reads it with log_read and acknowledges it (by asking for a later
// offset). When the host has not taken it, the container's writes to stdout/stderr block rather
// than the guest's memory growing: the pipes fill and the container waits, as with containerd.

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"sync"
	"time"
)

const (
	// logHold is what the agent keeps of one container's log that the host has not acknowledged.
	logHold = 1 << 20
	// logReadMax bounds one log_read answer (its base64 must fit the host's line limit).
	logReadMax = 512 * 1024
	// logWaitMax bounds how long one log_read waits for output.
	logWaitMax = 60 * time.Second
	// logKeep is the buffer an emptied log shrinks back to.
	logKeep = 64 * 1024
)

type logBuffer struct {
	mu      sync.Mutex
	cond    *sync.Cond
	base    int64  // stream offset of data[0]; everything before it was acknowledged
	data    []byte // whole CRI lines not yet acknowledged
	writers int    // output streams still open
	closed  bool   // the container was deleted: writes are dropped, reads refused
}

func newLogBuffer(writers int) *logBuffer {
	b := &logBuffer{writers: writers, data: make([]byte, 0, logKeep)}
	b.cond = sync.NewCond(&b.mu)
	return b
}

// write appends one CRI line, waiting while the buffer holds logHold bytes the host has not taken.
func (b *logBuffer) write(line []byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for !b.closed && len(b.data) > 0 && len(b.data)+len(line) > logHold {
		b.cond.Wait()
	}
	if !b.closed {
		b.data = append(b.data, line...)
		b.cond.Broadcast()
	}
}

// writerDone marks one output stream closed; with none left, readers see the end.
func (b *logBuffer) writerDone() {
	b.mu.Lock()
	b.writers--
	b.cond.Broadcast()
	b.mu.Unlock()
}

func (b *logBuffer) close() {
	b.mu.Lock()
	b.closed = true
	b.data = nil
	b.cond.Broadcast()
	b.mu.Unlock()
}

type logChunk struct {
	Offset int64  `json:"offset"`
	Data   string `json:"data"`
	EOF    bool   `json:"eof"`
}

// read drops what lies before offset (the host has copied it), then answers with up to max bytes
// from offset, waiting up to wait for some to arrive. Answers end at a line's end when one fits.
func (b *logBuffer) read(offset int64, max int, wait time.Duration) (logChunk, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return logChunk{}, fmt.Errorf("log_read: the container was deleted")
	}
	end := b.base + int64(len(b.data))
	if offset > end {
		return logChunk{}, fmt.Errorf("log_read: offset %d is past the end of the log (%d)", offset, end)
	}
	if offset > b.base {
		n := copy(b.data, b.data[offset-b.base:])
		b.data = b.data[:n]
		if n == 0 && cap(b.data) > logKeep {
			b.data = make([]byte, 0, logKeep) // an idle container keeps little
		}
		b.base = offset
		b.cond.Broadcast() // writers waiting for room
	}
	timedOut := false
	if wait > 0 {
		t := time.AfterFunc(wait, func() {
			b.mu.Lock()
			timedOut = true
			b.cond.Broadcast()
			b.mu.Unlock()
		})
		defer t.Stop()
	}
	for wait > 0 && len(b.data) == 0 && b.writers > 0 && !b.closed && !timedOut {
		b.cond.Wait()
	}
	if b.closed {
		return logChunk{}, fmt.Errorf("log_read: the container was deleted")
	}
	chunk := b.data
	if len(chunk) > max {
		chunk = chunk[:max]
		if nl := bytes.LastIndexByte(chunk, '\n'); nl >= 0 {
			chunk = chunk[:nl+1]
		}
	}
	eof := b.writers == 0 && len(chunk) == len(b.data)
	return logChunk{Offset: b.base, Data: base64.StdEncoding.EncodeToString(chunk), EOF: eof}, nil
}

type logReadArgs struct {
	ID       string `json:"id"`
	Offset   int64  `json:"offset"`
	MaxBytes int    `json:"max_bytes"`
	WaitMs   int64  `json:"wait_ms"`
}

func opLogRead(raw json.RawMessage) (interface{}, error) {
	var a logReadArgs
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("log_read: %v", err)
	}
	c, err := lookup(a.ID)
	if err != nil {
		return nil, err
	}
	if a.Offset < 0 || a.MaxBytes < 1 {
		return nil, fmt.Errorf("log_read: offset must not be negative and max_bytes must be positive")
	}
	if a.MaxBytes > logReadMax {
		a.MaxBytes = logReadMax
	}
	wait := time.Duration(a.WaitMs) * time.Millisecond
	if wait > logWaitMax {
		wait = logWaitMax
	}
	return c.log.read(a.Offset, a.MaxBytes, wait)
}

func init() {
	handlers["log_read"] = opLogRead
}
