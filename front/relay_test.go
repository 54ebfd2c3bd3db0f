package main

// The front between a client and two upstreams, in one process: x/net's HTTP/2 server stands in
// for the shim and the downstream (each a plain handler), x/net's transport or a raw framer for
// the client. What the relay must do with frames: flow control both ways, streaming, cancels,
// the shim's headers, and the paths of route.go.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// upstreamServer serves h on a unix socket with HTTP/2 (prior knowledge), as gRPC servers do.
func upstreamServer(t testing.TB, h http.HandlerFunc, window uint32) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "up.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	srv := &http2.Server{MaxUploadBufferPerStream: int32(window), MaxUploadBufferPerConnection: int32(window)}
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			go srv.ServeConn(nc, &http2.ServeConnOpts{Handler: h})
		}
	}()
	return sock
}

// grpcReply answers one gRPC message with OK, and extra headers first.
func grpcReply(w http.ResponseWriter, msg []byte, extra map[string]string) {
	for k, v := range extra {
		w.Header().Set(k, v)
	}
	w.Header().Set("Content-Type", "application/grpc")
	w.Header().Set("Trailer", "Grpc-Status")
	w.WriteHeader(200)
	w.Write(grpcBody(msg))
	w.Header().Set("Grpc-Status", "0")
}

func startFront(t *testing.T, shim, down string) (*front, string) {
	t.Helper()
	return startFrontWith(t, shim, down, nil)
}

// startFrontWith is startFront with set (if not nil) changing the front before it accepts.
func startFrontWith(t testing.TB, shim, down string, set func(*front)) (*front, string) {
	t.Helper()
	f := newFront(&upstream{name: "shim", addr: shim}, &upstream{name: "unix:///down.sock", addr: down}, 2*time.Second)
	if set != nil {
		set(f)
	}
	sock := filepath.Join(t.TempDir(), "cri.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go f.accept(ln)
	return f, sock
}

type reply struct {
	status  string // grpc-status
	message string
	msg     []byte
	header  http.Header
}

func h2client(sock string) *http.Client {
	return &http.Client{Transport: &http2.Transport{
		AllowHTTP: true,
		DialTLS:   func(string, string, *tls.Config) (net.Conn, error) { return net.Dial("unix", sock) },
	}}
}

func rpc(t *testing.T, c *http.Client, path string, msg []byte, hdr map[string]string) reply {
	t.Helper()
	r, err := tryRPC(c, path, msg, hdr)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return r
}

// tryRPC is rpc whose transport's failure (a reset stream, say) is the caller's to judge.
func tryRPC(c *http.Client, path string, msg []byte, hdr map[string]string) (reply, error) {
	req, _ := http.NewRequest("POST", "http://cri"+path, bytes.NewReader(grpcBody(msg)))
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	r := reply{header: resp.Header, status: resp.Trailer.Get("Grpc-Status"), message: resp.Trailer.Get("Grpc-Message")}
	if r.status == "" { // trailers-only
		r.status, r.message = resp.Header.Get("Grpc-Status"), resp.Header.Get("Grpc-Message")
	}
	if len(body) > 0 {
		m, ok := grpcMessage(body)
		if !ok {
			return r, fmt.Errorf("not one gRPC message: %d bytes", len(body))
		}
		r.msg = m
	}
	return r, nil
}

func readMsg(r *http.Request) []byte {
	b, _ := io.ReadAll(r.Body)
	m, _ := grpcMessage(b)
	return m
}

func TestLargeRequestAndReplyCrossSmallWindows(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		got := readMsg(r)
		grpcReply(w, append([]byte(fmt.Sprintf("%d:", len(got))), big...), nil)
	}, 16<<10)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	r := rpc(t, h2client(sock), runtimeService+"RunPodSandbox", big[:300<<10], nil)
	if r.status != "0" || !bytes.Equal(r.msg, append([]byte("307200:"), big...)) {
		t.Fatalf("status %q %q, %d bytes back", r.status, r.message, len(r.msg))
	}
}

// a client that reads slowly: the front sends no more than the client's window allows
func TestReplyWaitsForTheClientsWindow(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 200<<10)
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) { grpcReply(w, big, nil) }, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	nc, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	bw := bufio.NewWriter(nc)
	fr := http2.NewFramer(bw, nc)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	bw.WriteString(clientPreface)
	const window = 1000
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: window})
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", runtimeService + "RunPodSandbox"},
		{":authority", "cri"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	fr.WriteData(1, true, grpcBody(nil))
	bw.Flush()
	var got []byte
	granted := window // what the stream's window has allowed so far (the connection's is 65535)
	for {
		nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("after %d bytes: %v", len(got), err)
		}
		switch f := f.(type) {
		case *http2.DataFrame:
			got = append(got, f.Data()...)
			if len(got) > granted {
				t.Fatalf("%d bytes sent, the window allowed %d", len(got), granted)
			}
			if len(got) == granted { // read it all: give the window back, connection and stream
				fr.WriteWindowUpdate(0, window)
				fr.WriteWindowUpdate(1, window)
				bw.Flush()
				granted += window
			}
		case *http2.SettingsFrame:
			if !f.IsAck() {
				fr.WriteSettingsAck()
				bw.Flush()
			}
		case *http2.MetaHeadersFrame:
			if f.StreamEnded() {
				if m, ok := grpcMessage(got); !ok || !bytes.Equal(m, big) || f.PseudoValue("status") != "" && false {
					t.Fatalf("got %d bytes", len(got))
				}
				return
			}
		}
	}
}

func TestServerStreamingIsRelayedAsItComes(t *testing.T) {
	second := make(chan struct{})
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Trailer", "Grpc-Status")
		w.WriteHeader(200)
		w.Write(grpcBody([]byte("one")))
		w.(http.Flusher).Flush()
		<-second
		w.Write(grpcBody([]byte("two")))
		w.Header().Set("Grpc-Status", "0")
	}, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	req, _ := http.NewRequest("POST", "http://cri"+runtimeService+"GetContainerEvents", bytes.NewReader(grpcBody(nil)))
	req.Header.Set("Content-Type", "application/grpc")
	resp, err := h2client(sock).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make([]byte, 8)
	if _, err := io.ReadFull(resp.Body, first); err != nil || string(first[5:]) != "one" {
		t.Fatalf("the first message before the second is written: %q %v", first, err)
	}
	close(second)
	rest, _ := io.ReadAll(resp.Body)
	if string(rest[5:]) != "two" || resp.Trailer.Get("Grpc-Status") != "0" {
		t.Fatalf("rest %q, trailer %v", rest, resp.Trailer)
	}
}

func TestAClientsCancelReachesTheShim(t *testing.T) {
	cancelled := make(chan struct{})
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		close(cancelled)
	}, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://cri"+runtimeService+"StopPodSandbox", bytes.NewReader(grpcBody(nil)))
	req.Header.Set("Content-Type", "application/grpc")
	go func() { time.Sleep(200 * time.Millisecond); cancel() }()
	h2client(sock).Do(req)
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the shim's handler was not cancelled")
	}
}

// the shim says an id is the downstream's: later calls for it go there, and the shim's own
// headers never reach the client; when the downstream fails, the shim answers, told why
func TestAnIDTheShimNamesGoesStraightToTheDownstream(t *testing.T) {
	id := []byte(strings.Repeat("c", 64))
	var mu sync.Mutex
	var shimSaw []string
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		shimSaw = append(shimSaw, r.URL.Path+" "+r.Header.Get(headerDownstream)+" "+r.Header.Get(headerSide))
		mu.Unlock()
		grpcReply(w, []byte("from-shim"), map[string]string{headerOwner: "downstream"})
	}, 1<<20)
	downSock := filepath.Join(t.TempDir(), "down.sock")
	downLn, err := net.Listen("unix", downSock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http2.Server{}
	downSaw := 0
	go func() {
		for {
			nc, err := downLn.Accept()
			if err != nil {
				return
			}
			go srv.ServeConn(nc, &http2.ServeConnOpts{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				downSaw++
				mu.Unlock()
				if r.Header.Get(headerSide) != "" || r.Header.Get(headerDownstream) != "" {
					t.Errorf("a client's vmsandbox- header reached the downstream")
				}
				grpcReply(w, append([]byte("from-downstream:"), readMsg(r)...), nil)
			})})
		}
	}()
	_, sock := startFront(t, shim, downSock)
	c := h2client(sock)
	req := lenField(1, id)
	first := rpc(t, c, runtimeService+"ContainerStatus", req, nil)
	if string(first.msg) != "from-shim" || first.header.Get(headerOwner) != "" {
		t.Fatalf("first: %q, owner header %q", first.msg, first.header.Get(headerOwner))
	}
	second := rpc(t, c, runtimeService+"ContainerStatus", req, map[string]string{headerSide: "vmsandbox", headerDownstream: "x"})
	if !bytes.HasPrefix(second.msg, []byte("from-downstream:")) || !bytes.Equal(second.msg[16:], req) {
		t.Fatalf("second: %q", second.msg)
	}
	// a sandbox id is another kind: the shim still answers
	if r := rpc(t, c, runtimeService+"PodSandboxStatus", req, nil); string(r.msg) != "from-shim" {
		t.Fatalf("PodSandboxStatus: %q", r.msg)
	}
	downLn.Close()
	srv = nil
	// the downstream gone: the shim answers, told why
	f2, sock2 := startFront(t, shim, filepath.Join(t.TempDir(), "gone.sock"))
	f2.learn(containerID, string(id))
	r := rpc(t, h2client(sock2), runtimeService+"ContainerStatus", req, nil)
	mu.Lock()
	last := shimSaw[len(shimSaw)-1]
	mu.Unlock()
	if string(r.msg) != "from-shim" || !strings.Contains(last, "downstream CRI runtime unix:///down.sock") {
		t.Fatalf("fallback: %q, the shim saw %q", r.msg, last)
	}
	// removing it through the shim forgets it
	rpc(t, c, runtimeService+"RemoveContainer", req, nil)
	if r := rpc(t, c, runtimeService+"ContainerStatus", req, nil); string(r.msg) != "from-shim" {
		t.Fatalf("after RemoveContainer: %q", r.msg)
	}
}

// without a list channel: the shim's own side over gRPC, marked, and the replies concatenated
func TestListsAreMergedFromBothSides(t *testing.T) {
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == sawListPath {
			grpcReply(w, nil, nil)
			return
		}
		if r.Header.Get(headerSide) != "vmsandbox" {
			t.Errorf("the shim's side was asked without %s", headerSide)
		}
		grpcReply(w, lenField(1, []byte("vm")), nil)
	}, 1<<20)
	down := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		grpcReply(w, lenField(1, []byte("runc")), nil)
	}, 1<<20)
	_, sock := startFront(t, shim, down)
	r := rpc(t, h2client(sock), runtimeService+"ListPodSandbox", nil, nil)
	want := append(lenField(1, []byte("runc")), lenField(1, []byte("vm"))...)
	if r.status != "0" || !bytes.Equal(r.msg, want) {
		t.Fatalf("merged: %q %q", r.status, r.msg)
	}
}

func TestTheInternalServiceIsNotForClients(t *testing.T) {
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		t.Errorf("the shim was asked %s", r.URL.Path)
	}, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	if r := rpc(t, h2client(sock), sawListPath, nil, nil); r.status != "12" {
		t.Fatalf("status %q", r.status)
	}
}

func TestTheShimGoneIsUnavailable(t *testing.T) {
	_, sock := startFront(t, filepath.Join(t.TempDir(), "gone.sock"), filepath.Join(t.TempDir(), "none.sock"))
	r := rpc(t, h2client(sock), runtimeService+"Version", nil, nil)
	if r.status != "14" || !strings.Contains(r.message, "vmsandbox shim") {
		t.Fatalf("status %q %q", r.status, r.message)
	}
}

// fakeLists is the shim's end of the list channel: it answers every list with the records'
// generation it is at, and counts what it was asked.
type fakeLists struct {
	mu         sync.Mutex
	nc         net.Conn
	generation uint64
	asked      int
}

func (l *fakeLists) push(g uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.generation = g
	var frame [17]byte
	binary.BigEndian.PutUint32(frame[0:4], 13)
	frame[8] = listsGeneration
	binary.BigEndian.PutUint64(frame[9:], g)
	l.nc.Write(frame[:])
}

func (l *fakeLists) serve() {
	var head [9]byte
	for {
		if _, err := io.ReadFull(l.nc, head[:]); err != nil {
			return
		}
		req := make([]byte, binary.BigEndian.Uint32(head[0:4])-5)
		io.ReadFull(l.nc, req)
		l.mu.Lock()
		l.asked++
		msg := lenField(1, []byte(fmt.Sprintf("vm@%d", l.generation)))
		out := make([]byte, 9+8, 9+8+len(msg))
		binary.BigEndian.PutUint32(out[0:4], uint32(5+8+len(msg)))
		copy(out[4:8], head[4:8])
		out[8] = listsReplyKept
		binary.BigEndian.PutUint64(out[9:17], l.generation)
		l.nc.Write(append(out, msg...))
		l.mu.Unlock()
	}
}

func (l *fakeLists) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.asked
}

func TestTheShimsSideOfAListIsKeptWhileItsGenerationStands(t *testing.T) {
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) { grpcReply(w, nil, nil) }, 1<<20)
	down := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		grpcReply(w, lenField(1, []byte("runc")), nil)
	}, 1<<20)
	f, sock := startFront(t, shim, down)
	mine, theirs := net.Pipe()
	fake := &fakeLists{nc: theirs}
	go fake.serve()
	f.lists = newLocalLists(mine, f.setGeneration)
	fake.push(5)
	c := h2client(sock)
	list := func() string {
		r := rpc(t, c, runtimeService+"ListPodSandbox", nil, nil)
		fs, err := fields(r.msg)
		if err != nil || len(fs) != 2 || string(fs[0].bytes) != "runc" {
			t.Fatalf("merged: %q", r.msg)
		}
		return string(fs[1].bytes)
	}
	steps := []struct {
		name  string
		do    func()
		want  string
		asked int // the channel asked so far
	}{
		{"first: asked", func() {}, "vm@5", 1},
		{"again: kept", func() {}, "vm@5", 1},
		{"a new generation: asked", func() { fake.push(6) }, "vm@6", 2},
		{"kept at it", func() {}, "vm@6", 2},
		{"a call that may change the records: asked", func() { rpc(t, c, runtimeService+"StopPodSandbox", nil, nil) }, "vm@6", 3},
		{"a read-only one keeps it", func() { rpc(t, c, runtimeService+"PodSandboxStatus", nil, nil) }, "vm@6", 3},
	}
	for _, s := range steps {
		s.do()
		time.Sleep(20 * time.Millisecond) // the push is read by another goroutine
		if got := list(); got != s.want || fake.count() != s.asked {
			t.Fatalf("%s: %q, asked %d times", s.name, got, fake.count())
		}
	}
	theirs.Close() // the channel gone: nothing kept holds, the shim is asked over gRPC
	time.Sleep(20 * time.Millisecond)
	r := rpc(t, c, runtimeService+"ListPodSandbox", nil, nil)
	if !bytes.Equal(r.msg, lenField(1, []byte("runc"))) {
		t.Fatalf("without the channel: %q", r.msg)
	}
}

// raw is a client that writes frames as it likes.
type raw struct {
	nc   net.Conn
	bw   *bufio.Writer
	fr   *http2.Framer
	hb   bytes.Buffer
	enc  *hpack.Encoder
	read counted // what the front sent
}

// counted reads from a connection and counts the bytes.
type counted struct {
	r io.Reader
	n int64
}

func (c *counted) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func dialRaw(t *testing.T, sock string) *raw {
	t.Helper()
	nc, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	r := &raw{nc: nc, bw: bufio.NewWriter(nc), read: counted{r: nc}}
	r.fr = http2.NewFramer(r.bw, &r.read)
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	r.enc = hpack.NewEncoder(&r.hb)
	r.bw.WriteString(clientPreface)
	r.fr.WriteSettings()
	r.bw.Flush()
	return r
}

func (r *raw) headers(id uint32, end bool, fields ...[2]string) {
	r.hb.Reset()
	for _, f := range fields {
		r.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hb.Bytes(), EndHeaders: true, EndStream: end})
	r.bw.Flush()
}

func request(method string) [][2]string {
	return [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", runtimeService + method},
		{":authority", "cri"}, {"content-type", "application/grpc"}}
}

// until reads frames until one of stream id that ends it (a reset, or an end of stream).
func (r *raw) until(t *testing.T, id uint32) http2.Frame {
	t.Helper()
	for {
		r.nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		f, err := r.fr.ReadFrame()
		if err != nil {
			t.Fatalf("waiting on stream %d: %v", id, err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				r.fr.WriteSettingsAck()
				r.bw.Flush()
			}
		case *http2.RSTStreamFrame:
			if f.StreamID == id {
				return f
			}
		case *http2.MetaHeadersFrame:
			if f.StreamID == id && f.StreamEnded() {
				return f
			}
		case *http2.DataFrame:
			if f.StreamID == id && f.StreamEnded() {
				return f
			}
		}
	}
}

func TestAMisbehavingStreamIsResetAndTheConnectionGoesOn(t *testing.T) {
	served := make(chan string, 16)
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		served <- r.URL.Path
		grpcReply(w, []byte("v"), nil)
	}, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	r := dialRaw(t, sock)
	// a header name in capitals (RFC 9113 8.2.1): the framer's stream error; that stream only
	r.headers(1, true, append(request("StopPodSandbox"), [2]string{"X-Capital", "1"})...)
	if f, ok := r.until(t, 1).(*http2.RSTStreamFrame); !ok || f.ErrCode != http2.ErrCodeProtocol {
		t.Fatalf("stream 1: %#v", f)
	}
	// a whole request, then data after its end: served once, then reset
	r.headers(3, false, request("StopContainer")...)
	r.fr.WriteData(3, true, grpcBody(nil))
	r.fr.WriteData(3, true, grpcBody(nil))
	r.bw.Flush()
	switch f := r.until(t, 3).(type) { // its answer, or the reset if the extra data came first
	case *http2.RSTStreamFrame:
		if f.ErrCode != http2.ErrCodeStreamClosed {
			t.Fatalf("stream 3: %v", f.ErrCode)
		}
	case *http2.MetaHeadersFrame:
	default:
		t.Fatalf("stream 3: %#v", f)
	}
	// and the connection still serves
	r.headers(5, false, request("RemoveContainer")...)
	r.fr.WriteData(5, true, grpcBody(nil))
	r.bw.Flush()
	if f, ok := r.until(t, 5).(*http2.MetaHeadersFrame); !ok || f.PseudoValue("status") == "" && header(f.Fields, "grpc-status") != "0" {
		t.Fatalf("stream 5: %#v", f)
	}
	close(served)
	paths := map[string]bool{}
	for p := range served {
		paths[p] = true
	}
	if paths[runtimeService+"StopPodSandbox"] || !paths[runtimeService+"RemoveContainer"] {
		t.Fatalf("the shim served %v: never stream 1's, always stream 5's", paths)
	}
}

// a client that stops reading its socket holds no one else: the shim's connection, which carries
// every client's calls, writes to it for writeTimeout at most
func TestAClientThatStopsReadingHoldsNoOneElse(t *testing.T) {
	was := writeTimeout.Swap(int64(300 * time.Millisecond))
	defer writeTimeout.Store(was)
	big := bytes.Repeat([]byte("x"), 8<<20)
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/StopPodSandbox") {
			grpcReply(w, big, nil)
			return
		}
		grpcReply(w, []byte("small"), nil)
	}, 1<<20)
	_, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	stuck := dialRaw(t, sock)
	stuck.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	stuck.fr.WriteWindowUpdate(0, 1<<31-1-65535)
	stuck.headers(1, false, request("StopPodSandbox")...)
	stuck.fr.WriteData(1, true, grpcBody(nil))
	stuck.bw.Flush() // and never reads again
	time.Sleep(100 * time.Millisecond)
	c := h2client(sock)
	for i := 0; i < 3; i++ {
		done := make(chan reply, 1)
		go func() { done <- rpc(t, c, runtimeService+"StopContainer", nil, nil) }()
		select {
		case r := <-done:
			if string(r.msg) != "small" {
				t.Fatalf("call %d: %q", i, r.msg)
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("call %d waits behind the client that stopped reading", i)
		}
	}
}
