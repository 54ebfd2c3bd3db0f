package main

// The time bounds of a client connection: a reply that waits for a window the client never
// grants, a connection that stays idle, a handshake that never ends; and the per-connection cap
// on replies waiting for window.

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// bigLists is a downstream whose ListContainers reply is n bytes, or n+extra asked with an
// x-more field (its other calls are small).
func bigLists(t *testing.T, n, extra int) string {
	big := bytes.Repeat([]byte("l"), n+extra)
	return upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		readMsg(r)
		if strings.HasSuffix(r.URL.Path, "/ListContainers") {
			if r.Header.Get("X-More") != "" {
				grpcReply(w, big, nil)
			} else {
				grpcReply(w, big[:n], nil)
			}
			return
		}
		grpcReply(w, []byte("down"), nil)
	}, 1<<20)
}

// headersOn sends a call on stream id and reads until its reply's headers (its data may wait).
func (r *raw) headersOn(t *testing.T, id uint32, method string) {
	t.Helper()
	r.headers(id, false, request(method)...)
	r.fr.WriteData(id, true, grpcBody(nil))
	r.bw.Flush()
	for {
		r.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		f, err := r.fr.ReadFrame()
		if err != nil {
			t.Fatalf("waiting for stream %d's headers: %v", id, err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				r.fr.WriteSettingsAck()
				r.bw.Flush()
			}
		case *http2.MetaHeadersFrame:
			if f.StreamID == id {
				return
			}
		case *http2.RSTStreamFrame:
			if f.StreamID == id {
				t.Fatalf("stream %d reset (%v) before its headers", id, f.ErrCode)
			}
		}
	}
}

// eventually polls cond every 10 ms for within; false if it never held.
func eventually(within time.Duration, cond func() bool) bool {
	for end := time.Now().Add(within); ; time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(end) {
			return false
		}
	}
}

// A client that keeps reading but never grants window holds the bytes of its replies no longer
// than windowTimeout: its streams are reset (CANCEL), the bytes go back to the front's budget,
// and another client's call that the budget could not take before is served.
func TestAReplyWaitingForAWindowNeverGrantedIsResetAndItsBytesGivenBack(t *testing.T) {
	const reply, more = 300 << 10, 200 << 10
	// the budget takes 3 waiting replies and a fourth being collected, not 3 and a larger one
	f, sock := startFrontWith(t, okShim(t, nil), bigLists(t, reply, more), func(f *front) {
		f.budget = newBudget(1200 << 10)
		f.windowTimeout = time.Second
	})
	stuck := dialRaw(t, sock) // 65,535 bytes of window, never more
	start := time.Now()
	for _, id := range []uint32{1, 3, 5} {
		stuck.headersOn(t, id, "ListContainers")
	}
	// 3 replies of 300 KiB, 64 KiB of them sent: the rest waits, counted in the budget
	if !eventually(time.Second, func() bool { return f.budget.used.Load() >= 3*reply-(64<<10) }) {
		t.Fatalf("the waiting replies are not counted: %d bytes", f.budget.used.Load())
	}
	if time.Since(start) >= f.windowTimeout {
		t.Skip("too slow a machine to see the replies wait")
	}

	// another client's list of 500 KiB is more than the budget has left: it is served once the
	// stuck client's replies are given up, while that client is still connected (until then
	// the front answers it from the shim alone, as for a downstream that failed)
	other := h2client(sock)
	for i := 0; ; i++ {
		r, err := tryRPC(other, runtimeService+"ListContainers", nil, map[string]string{"X-More": "1"})
		if err == nil && r.status == "0" && len(r.msg) == reply+more+len("ok") {
			break
		}
		if time.Since(start) > f.windowTimeout+3*time.Second {
			t.Fatalf("another client's call is not served while the stuck client holds its replies: %v %q %q (budget %d)",
				err, r.status, r.message, f.budget.used.Load())
		}
		time.Sleep(100 * time.Millisecond)
	}
	reset := map[uint32]http2.ErrCode{}
	for len(reset) < 3 {
		stuck.nc.SetReadDeadline(time.Now().Add(3 * time.Second))
		fr, err := stuck.fr.ReadFrame()
		if err != nil {
			t.Fatalf("the stuck client's streams: %v (reset: %v)", err, reset)
		}
		if rst, ok := fr.(*http2.RSTStreamFrame); ok {
			reset[rst.StreamID] = rst.ErrCode
		}
	}
	for id, code := range reset {
		if code != http2.ErrCodeCancel {
			t.Fatalf("stream %d reset with %v", id, code)
		}
	}
	if waited := time.Since(start); waited < f.windowTimeout {
		t.Fatalf("the replies were reset after %v, before their %v", waited, f.windowTimeout)
	}
	stuck.sync(t) // its connection is still served
	if !eventually(time.Second, func() bool { return f.budget.used.Load() == 0 }) {
		t.Fatalf("%d bytes still held", f.budget.used.Load())
	}
}

// one connection's replies waiting for window are capped well below the front's budget
func TestAConnectionsWaitingRepliesAreCappedBelowTheBudget(t *testing.T) {
	if maxConnPending*8 > defaultMaxBuffered {
		t.Fatalf("a connection may hold %d bytes of the %d of all", maxConnPending, defaultMaxBuffered)
	}
	const reply = 300 << 10
	f, sock := startFrontWith(t, okShim(t, nil), bigLists(t, reply, 0), func(f *front) { f.connPending = 400 << 10 })
	a := dialRaw(t, sock)
	a.headersOn(t, 1, "ListContainers") // 236 KiB wait
	a.headers(3, false, request("ListContainers")...)
	a.fr.WriteData(3, true, grpcBody(nil))
	a.bw.Flush()
	if got := a.status(t, 3); got != "RST ENHANCE_YOUR_CALM" { // 300 KiB more would pass 400 KiB
		t.Fatalf("a reply beyond its connection's cap: %q", got)
	}
	b := dialRaw(t, sock) // another connection has a cap of its own
	b.headersOn(t, 1, "ListContainers")
	if !eventually(time.Second, func() bool { return f.budget.used.Load() == 2*(reply+5+2-65535) }) {
		t.Fatalf("%d bytes held", f.budget.used.Load())
	}
}

// a connection with no stream and no frame for idleTimeout is told GOAWAY NO_ERROR and closed;
// one that carries calls, or has a call open, is never cut
func TestAnIdleConnectionIsToldToGoAway(t *testing.T) {
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		readMsg(r)
		if strings.HasSuffix(r.URL.Path, "/StopPodSandbox") {
			time.Sleep(900 * time.Millisecond) // a call open longer than the idle timeout
		}
		grpcReply(w, []byte("ok"), nil)
	}, 1<<20)
	const idle = 300 * time.Millisecond
	f, sock := startFrontWith(t, shim, filepath.Join(t.TempDir(), "none.sock"), func(f *front) { f.idleTimeout = idle })

	quiet := dialRaw(t, sock)
	if got := quiet.call(t, 1, "Status"); got != "0" {
		t.Fatalf("Status: %q", got)
	}
	since := time.Now()
	quiet.nc.SetReadDeadline(time.Now().Add(3 * time.Second))
	var away *http2.GoAwayFrame
	for away == nil {
		fr, err := quiet.fr.ReadFrame()
		if err != nil {
			t.Fatalf("an idle connection: no GOAWAY: %v", err)
		}
		away, _ = fr.(*http2.GoAwayFrame)
	}
	if waited := time.Since(since); waited < idle-50*time.Millisecond {
		t.Fatalf("GOAWAY after %v idle, before %v", waited, idle)
	}
	if away.ErrCode != http2.ErrCodeNo || away.LastStreamID != 1 {
		t.Fatalf("GOAWAY %v, last stream %d", away.ErrCode, away.LastStreamID)
	}
	if _, err := quiet.fr.ReadFrame(); !errors.Is(err, io.EOF) {
		t.Fatalf("after its GOAWAY the connection ends: %v", err)
	}

	busy := dialRaw(t, sock) // a call every 100 ms, for 4 idle timeouts: the kubelet's way
	for id := uint32(1); id < 25; id += 2 {
		if got := busy.call(t, id, "Status"); got != "0" {
			t.Fatalf("call %d on a busy connection: %q", id, got)
		}
		time.Sleep(100 * time.Millisecond)
	}
	open := dialRaw(t, sock) // one call longer than the idle timeout
	if got := open.call(t, 1, "StopPodSandbox"); got != "0" {
		t.Fatalf("a call open longer than the idle timeout: %q", got)
	}
	if got := open.call(t, 3, "Status"); got != "0" {
		t.Fatalf("the next call on it: %q", got)
	}
	if !eventually(3*time.Second, func() bool { return f.conns.Load() == 0 }) {
		t.Fatalf("%d connections left once all are idle", f.conns.Load())
	}
}

// a connection whose preface and SETTINGS do not come within handshakeTimeout is closed, and its
// slot given back
func TestAHandshakeThatDoesNotEndIsClosed(t *testing.T) {
	const limit = 300 * time.Millisecond
	f, sock := startFrontWith(t, okShim(t, nil), filepath.Join(t.TempDir(), "none.sock"), func(f *front) {
		f.handshakeTimeout = limit
		f.maxConns = 2
	})
	for _, c := range []struct {
		name string
		sent string
	}{
		{"nothing", ""},
		{"half a preface", clientPreface[:10]},
		{"the preface without SETTINGS", clientPreface},
	} {
		t.Run(c.name, func(t *testing.T) {
			nc, err := net.Dial("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			nc.Write([]byte(c.sent))
			start := time.Now()
			nc.SetReadDeadline(start.Add(3 * time.Second))
			_, err = io.Copy(io.Discard, nc) // the front's SETTINGS, if any, then its end
			if err != nil {
				t.Fatalf("the connection is not closed: %v", err)
			}
			if waited := time.Since(start); waited < limit-50*time.Millisecond || waited > limit+time.Second {
				t.Fatalf("closed after %v (handshake timeout %v)", waited, limit)
			}
		})
	}
	if !eventually(time.Second, func() bool { return f.conns.Load() == 0 }) {
		t.Fatalf("%d slots held", f.conns.Load())
	}
	r := dialRaw(t, sock) // a handshake in time: served, and not closed after the timeout
	time.Sleep(2 * limit)
	if got := r.call(t, 1, "Status"); got != "0" {
		t.Fatalf("Status: %q", got)
	}
}
