package main

// Hostile clients of the CRI socket, one test per way to hurt the front or the callers sharing it:
// SETTINGS and window values out of range, too many connections or buffered bytes, a peer that
// stops reading, rapid reset, CONTINUATION floods and oversized header blocks.

import (
	"bytes"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// okShim answers every call with a small message, and counts them.
func okShim(t *testing.T, calls *atomic.Int64) string {
	return upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		if calls != nil {
			calls.Add(1)
		}
		readMsg(r)
		grpcReply(w, []byte("ok"), nil)
	}, 1<<20)
}

// goAway reads what the front sends until its GOAWAY and then the connection's end, within
// the time and at most maxBytes; it fails the test otherwise. It writes nothing (the test may).
func (r *raw) goAway(t *testing.T, want http2.ErrCode, within time.Duration, maxBytes int64) {
	t.Helper()
	deadline := time.Now().Add(within)
	got := false
	for {
		r.nc.SetReadDeadline(deadline)
		f, err := r.fr.ReadFrame()
		if r.read.n > maxBytes {
			t.Fatalf("the front sent %d bytes (at most %d expected)", r.read.n, maxBytes)
		}
		if err != nil {
			if !got {
				t.Fatalf("no GOAWAY %v: %v (%d bytes read)", want, err, r.read.n)
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatalf("the connection stays open after its GOAWAY")
			}
			return
		}
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			if f.ErrCode != want {
				t.Fatalf("GOAWAY %v, want %v", f.ErrCode, want)
			}
			got = true
		}
	}
}

// call is a whole request on stream id (no body but the empty message) and its answer's status.
func (r *raw) call(t *testing.T, id uint32, method string) string {
	t.Helper()
	r.headers(id, false, request(method)...)
	r.fr.WriteData(id, true, grpcBody(nil))
	r.bw.Flush()
	return r.status(t, id)
}

// status is the grpc-status that ends stream id ("RST <code>" for a reset).
func (r *raw) status(t *testing.T, id uint32) string {
	t.Helper()
	switch f := r.until(t, id).(type) {
	case *http2.MetaHeadersFrame:
		return header(f.Fields, "grpc-status")
	case *http2.RSTStreamFrame:
		return "RST " + f.ErrCode.String()
	default:
		t.Fatalf("stream %d ended by %T", id, f)
		return ""
	}
}

// RFC 9113 6.5.2: a value out of its range is a connection error, never a spin on it
func TestSettingsOutOfRangeEndTheConnection(t *testing.T) {
	shim := okShim(t, nil)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	cases := []struct {
		name string
		s    http2.Setting
		want http2.ErrCode
	}{
		{"MAX_FRAME_SIZE 0", http2.Setting{ID: http2.SettingMaxFrameSize, Val: 0}, http2.ErrCodeProtocol},
		{"MAX_FRAME_SIZE 16383", http2.Setting{ID: http2.SettingMaxFrameSize, Val: 16383}, http2.ErrCodeProtocol},
		{"MAX_FRAME_SIZE 2^24", http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1 << 24}, http2.ErrCodeProtocol},
		{"ENABLE_PUSH 2", http2.Setting{ID: http2.SettingEnablePush, Val: 2}, http2.ErrCodeProtocol},
		{"ENABLE_CONNECT_PROTOCOL 2", http2.Setting{ID: http2.SettingEnableConnectProtocol, Val: 2}, http2.ErrCodeProtocol},
		{"INITIAL_WINDOW_SIZE 2^31", http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 31}, http2.ErrCodeFlowControl},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, sock)
			r.fr.WriteSettings(c.s)
			r.headers(1, true, request("Status")...)
			r.goAway(t, c.want, 3*time.Second, 64<<10)
		})
	}
	// and a value in range is taken: replies come in frames of at most that size
	r := dialRaw(t, sock)
	r.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 1<<24 - 1})
	if got := r.call(t, 1, "Status"); got != "0" {
		t.Fatalf("Status after a valid MAX_FRAME_SIZE: %q", got)
	}
}

// RFC 9113 6.9.1: a window beyond 2^31-1 is a FLOW_CONTROL_ERROR, of the connection or of the stream
func TestAWindowBeyondItsMaximumIsAFlowControlError(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/StopPodSandbox") {
			<-hold
		}
		grpcReply(w, []byte("ok"), nil)
	}, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	r := dialRaw(t, sock)
	r.headers(1, false, request("StopPodSandbox")...)
	r.fr.WriteData(1, true, grpcBody(nil))
	r.fr.WriteWindowUpdate(1, 1<<31-1)
	r.bw.Flush()
	if got := r.status(t, 1); got != "RST FLOW_CONTROL_ERROR" {
		t.Fatalf("stream window overflow: %q", got)
	}
	if got := r.call(t, 3, "Status"); got != "0" {
		t.Fatalf("the connection after a stream's error: %q", got)
	}
	r.fr.WriteWindowUpdate(0, 1<<31-1)
	r.bw.Flush()
	r.goAway(t, http2.ErrCodeFlowControl, 3*time.Second, 64<<10)
}

func TestConnectionsAreBoundedForTheWholeFront(t *testing.T) {
	_, sock := startFrontWith(t, okShim(t, nil), filepath.Join(t.TempDir(), "none.sock"), func(f *front) { f.maxConns = 2 })
	a, b := dialRaw(t, sock), dialRaw(t, sock)
	if a.call(t, 1, "Status") != "0" || b.call(t, 1, "Status") != "0" {
		t.Fatal("the first two connections are served")
	}
	c := dialRaw(t, sock)
	c.goAway(t, http2.ErrCodeEnhanceYourCalm, 2*time.Second, 1<<10)
	a.nc.Close()
	for i := 0; ; i++ { // a's slot is free once the front has seen it close
		d := dialRaw(t, sock)
		d.headers(1, false, request("Status")...)
		d.fr.WriteData(1, true, grpcBody(nil))
		d.bw.Flush()
		if f, err := d.firstOn(1); err == nil {
			if mh, ok := f.(*http2.MetaHeadersFrame); ok && header(mh.Fields, "grpc-status") == "0" {
				break
			}
		}
		if i == 20 {
			t.Fatal("a connection closed gives its slot back")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// firstOn reads until stream id ends (or the connection does), without failing the test.
func (r *raw) firstOn(id uint32) (http2.Frame, error) {
	for {
		r.nc.SetReadDeadline(time.Now().Add(2 * time.Second))
		f, err := r.fr.ReadFrame()
		if err != nil {
			return nil, err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				r.fr.WriteSettingsAck()
				r.bw.Flush()
			}
		case *http2.GoAwayFrame:
			return nil, errors.New("GOAWAY " + f.ErrCode.String())
		case *http2.MetaHeadersFrame:
			if f.StreamID == id && f.StreamEnded() {
				return f, nil
			}
		case *http2.RSTStreamFrame:
			if f.StreamID == id {
				return f, nil
			}
		}
	}
}

// sync waits until the front has read everything sent before (a PING's answer comes after).
func (r *raw) sync(t *testing.T) {
	t.Helper()
	r.fr.WritePing(false, [8]byte{'s', 'y', 'n', 'c'})
	r.bw.Flush()
	for {
		r.nc.SetReadDeadline(time.Now().Add(3 * time.Second))
		f, err := r.fr.ReadFrame()
		if err != nil {
			t.Fatalf("sync: %v", err)
		}
		switch f := f.(type) {
		case *http2.PingFrame:
			if f.IsAck() {
				return
			}
		case *http2.SettingsFrame:
			if !f.IsAck() {
				r.fr.WriteSettingsAck()
				r.bw.Flush()
			}
		}
	}
}

// bytes held for requests count against one budget for all connections, not one per connection
func TestBufferedBytesAreBoundedForTheWholeFront(t *testing.T) {
	var calls atomic.Int64
	_, sock := startFrontWith(t, okShim(t, &calls), filepath.Join(t.TempDir(), "none.sock"), func(f *front) { f.budget = newBudget(1 << 20) })
	chunk := make([]byte, 16<<10)
	a := dialRaw(t, sock)
	a.headers(1, false, request("RunPodSandbox")...)
	for i := 0; i < 56; i++ { // 896 KiB of a request not yet whole
		a.fr.WriteData(1, false, chunk)
	}
	a.bw.Flush()
	a.sync(t)
	b := dialRaw(t, sock)
	send := func(id uint32) string {
		b.headers(id, false, request("RunPodSandbox")...)
		for i := 0; i < 12; i++ { // 192 KiB more would pass the budget
			b.fr.WriteData(id, false, chunk)
		}
		b.fr.WriteData(id, true, nil)
		b.bw.Flush()
		return b.status(t, id)
	}
	if got := send(1); got != "8" && got != "RST REFUSED_STREAM" {
		t.Fatalf("a request beyond the front's budget: %q, shim called %d times", got, calls.Load())
	}
	a.fr.WriteRSTStream(1, http2.ErrCodeCancel) // a's bytes are given back
	a.bw.Flush()
	a.sync(t)
	if got := send(3); got != "0" {
		t.Fatalf("within the budget again: %q", got)
	}
}

// a client that stops reading its socket holds neither the shim's read loop, nor the
// downstream's, nor any other client: each peer's writes wait in its own queue
func TestAClientThatNeverReadsHoldsNoSharedLoop(t *testing.T) {
	was := writeTimeout.Swap(int64(20 * time.Second))
	defer writeTimeout.Store(was)
	big := bytes.Repeat([]byte("x"), 8<<20)
	id := []byte(strings.Repeat("c", 64))
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/StopPodSandbox") {
			grpcReply(w, big, nil)
			return
		}
		grpcReply(w, []byte("small"), nil)
	}, 1<<20)
	down := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(string(readMsg(r)), "\x0a\x01x") {
			grpcReply(w, big, nil)
			return
		}
		grpcReply(w, []byte("down"), nil)
	}, 1<<20)
	f, sock := startFront(t, shim, down)
	f.learn(containerID, "x")
	f.learn(containerID, string(id))
	stuck := dialRaw(t, sock)
	stuck.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	stuck.fr.WriteWindowUpdate(0, 1<<31-1-65535)
	for i, m := range []string{"StopPodSandbox", "ContainerStatus", "StopPodSandbox", "ContainerStatus"} {
		sid := uint32(2*i + 1)
		stuck.headers(sid, false, request(m)...)
		stuck.fr.WriteData(sid, true, grpcBody(lenField(1, []byte("x"))))
	}
	stuck.bw.Flush() // and never reads again
	time.Sleep(300 * time.Millisecond)
	c := h2client(sock)
	for i := 0; i < 3; i++ {
		for _, m := range []string{"Status", "ContainerStatus"} {
			done := make(chan reply, 1)
			go func() { done <- rpc(t, c, runtimeService+m, lenField(1, id), nil) }()
			select {
			case r := <-done:
				if r.status != "0" {
					t.Fatalf("%s %d: %q %q", m, i, r.status, r.message)
				}
			case <-time.After(time.Second):
				t.Fatalf("%s %d waits behind the client that stopped reading", m, i)
			}
		}
	}
}

// the shim's list channel not read: the client that asked a list is held by nothing but its
// own list, which goes to the shim over gRPC once the channel is cut
func TestAListChannelThatStopsReadingHoldsNoClient(t *testing.T) {
	was := writeTimeout.Swap(int64(300 * time.Millisecond))
	defer writeTimeout.Store(was)
	shim := okShim(t, nil)
	down := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) { grpcReply(w, nil, nil) }, 1<<20)
	f, sock := startFront(t, shim, down)
	mine, theirs := net.Pipe() // the shim's end is never read
	defer theirs.Close()
	f.lists = newLocalLists(mine, f.setGeneration)
	c := h2client(sock)
	listed := make(chan reply, 1)
	go func() { listed <- rpc(t, c, runtimeService+"ListPodSandbox", nil, nil) }()
	time.Sleep(50 * time.Millisecond)
	done := make(chan reply, 1)
	go func() { done <- rpc(t, c, runtimeService+"Status", nil, nil) }()
	select {
	case r := <-done:
		if r.status != "0" {
			t.Fatalf("Status: %q", r.status)
		}
	case <-time.After(time.Second):
		t.Fatal("Status waits behind a list the shim's channel does not take")
	}
	select {
	case r := <-listed:
		if r.status != "0" {
			t.Fatalf("the list: %q %q", r.status, r.message)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the list is not answered once its channel is cut")
	}
}

// CVE-2023-44487: streams opened and reset at once, without end
func TestRapidResetEndsTheConnection(t *testing.T) {
	var calls atomic.Int64
	_, sock := startFront(t, okShim(t, &calls), filepath.Join(t.TempDir(), "none.sock"))
	r := dialRaw(t, sock)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for id := uint32(1); id < 20000; id += 2 {
			r.hb.Reset()
			for _, f := range request("Status") {
				r.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
			}
			r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hb.Bytes(), EndHeaders: true, EndStream: true})
			r.fr.WriteRSTStream(id, http2.ErrCodeCancel)
			if r.bw.Flush() != nil {
				return
			}
		}
	}()
	r.goAway(t, http2.ErrCodeEnhanceYourCalm, 5*time.Second, 4<<20)
	r.nc.Close()
	wg.Wait()
	if n := calls.Load(); n > 2*maxResets {
		t.Fatalf("the shim was called %d times", n)
	}
}

// CVE-2023-45288: a header block that never ends, in CONTINUATION frames of no bytes
func TestAContinuationFloodEndsTheConnection(t *testing.T) {
	_, sock := startFront(t, okShim(t, nil), filepath.Join(t.TempDir(), "none.sock"))
	r := dialRaw(t, sock)
	r.hb.Reset()
	r.enc.WriteField(hpack.HeaderField{Name: ":method", Value: "POST"})
	r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: r.hb.Bytes()})
	r.bw.Flush()
	go func() {
		for i := 0; i < 200000; i++ {
			if r.fr.WriteContinuation(1, false, nil) != nil {
				return
			}
		}
		r.bw.Flush()
	}()
	r.goAway(t, http2.ErrCodeProtocol, 3*time.Second, 64<<10)
}

// a header block that decodes to more than the front takes (a small block can: HPACK indexes a
// field once and names it again in one byte) is answered RESOURCE_EXHAUSTED, never forwarded cut
func TestAnOversizedHeaderBlockIsNotForwarded(t *testing.T) {
	var calls atomic.Int64
	_, sock := startFront(t, okShim(t, &calls), filepath.Join(t.TempDir(), "none.sock"))
	r := dialRaw(t, sock)
	fields := request("StopPodSandbox")
	for i := 0; i < 20; i++ {
		fields = append(fields, [2]string{"x-big", strings.Repeat("a", 4000)})
	}
	r.headers(1, false, fields...)
	r.fr.WriteData(1, true, grpcBody(nil))
	r.bw.Flush()
	if got := r.status(t, 1); got != "8" {
		t.Fatalf("an oversized request header block: %q, the shim called %d times", got, calls.Load())
	}
	if calls.Load() != 0 {
		t.Fatal("the shim was called")
	}
	if got := r.call(t, 3, "Status"); got != "0" || calls.Load() != 1 {
		t.Fatalf("the next call: %q", got)
	}
}

// a call its client gives up while its reply is being collected gives the reply's bytes back
func TestAGivenUpCallGivesItsBytesBack(t *testing.T) {
	started := make(chan struct{}, 1)
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/grpc")
		w.WriteHeader(200)
		w.Write(make([]byte, 100<<10)) // part of a reply, and then nothing
		w.(http.Flusher).Flush()
		started <- struct{}{}
		<-r.Context().Done()
	}, 1<<20)
	f, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	r := dialRaw(t, sock)
	r.headers(1, false, request("Version")...) // collected whole before it is answered
	r.fr.WriteData(1, true, grpcBody(nil))
	r.bw.Flush()
	<-started
	for i := 0; f.budget.used.Load() < 100<<10; i++ {
		if i == 100 {
			t.Fatalf("the reply's bytes are not counted: %d", f.budget.used.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	r.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	r.bw.Flush()
	for i := 0; f.budget.used.Load() != 0; i++ {
		if i == 100 {
			t.Fatalf("%d bytes still held", f.budget.used.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// a reply collected whole and a cancel of its call at the same time give its bytes back once
func TestACollectorGivesItsBytesBackOnce(t *testing.T) {
	b := newBudget(1 << 20)
	c := &collector{b: b, done: func(result) {}}
	c.data(make([]byte, 100), false)
	c.headers(okTrailers(), true) // the reply's end, from the upstream's read loop
	c.release()                   // the client's cancel, before the call is marked finished
	if n := b.used.Load(); n != 0 {
		t.Fatalf("%d bytes counted", n)
	}
}
