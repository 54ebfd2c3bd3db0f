package main

// Fuzz targets for what the front reads from its peers: a client's bytes after the preface, an
// upstream's replies, and the shim's list channel. Each input must end in bounded time, with
// bounded output that is well-formed HTTP/2, and leave no call without its answer.

import (
	"bytes"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// frames writes frames with a framer of its own, as seeds.
type frames struct {
	b   bytes.Buffer
	fr  *http2.Framer
	hb  bytes.Buffer
	enc *hpack.Encoder
}

func newFrames() *frames {
	f := &frames{}
	f.fr = http2.NewFramer(&f.b, nil)
	f.enc = hpack.NewEncoder(&f.hb)
	return f
}

func (f *frames) block(fields [][2]string) []byte {
	f.hb.Reset()
	for _, h := range fields {
		f.enc.WriteField(hpack.HeaderField{Name: h[0], Value: h[1]})
	}
	return append([]byte(nil), f.hb.Bytes()...)
}

func (f *frames) call(id uint32, method string, msg []byte) *frames {
	f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: f.block(request(method)), EndHeaders: true})
	f.fr.WriteData(id, true, grpcBody(msg))
	return f
}

// clientSeeds are inputs after the preface: well-formed calls and the hostile cases of hostile_test.go.
func clientSeeds() [][]byte {
	var seeds [][]byte
	f := newFrames()
	f.fr.WriteSettings()
	f.call(1, "Status", nil).call(3, "Version", nil).call(5, "ListPodSandbox", nil)
	f.call(7, "ContainerStatus", lenField(1, []byte("abc"))).call(9, "RemoveContainer", lenField(1, []byte("abc")))
	f.fr.WritePing(false, [8]byte{1})
	f.fr.WriteWindowUpdate(0, 1000)
	seeds = append(seeds, f.b.Bytes())

	f = newFrames() // the report: MAX_FRAME_SIZE 0, then a call
	f.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 0})
	f.call(1, "Status", nil)
	seeds = append(seeds, f.b.Bytes())

	f = newFrames() // a small window, a reply larger than it, then more window
	f.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 10})
	f.call(1, "Version", nil)
	f.fr.WriteWindowUpdate(1, 100)
	f.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	seeds = append(seeds, f.b.Bytes())

	f = newFrames() // a header block in pieces, then one that never ends
	f.fr.WriteSettings()
	blk := f.block(request("Status"))
	f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: blk[:3], EndStream: true})
	f.fr.WriteContinuation(1, false, blk[3:6])
	f.fr.WriteContinuation(1, true, blk[6:])
	f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 3, BlockFragment: blk[:3]})
	for i := 0; i < 20; i++ {
		f.fr.WriteContinuation(3, false, nil)
	}
	seeds = append(seeds, f.b.Bytes())

	f = newFrames() // streams opened and reset
	f.fr.WriteSettings()
	for id := uint32(1); id < 300; id += 2 {
		f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: f.block(request("Status")), EndHeaders: true, EndStream: true})
		f.fr.WriteRSTStream(id, http2.ErrCodeCancel)
	}
	seeds = append(seeds, f.b.Bytes())
	return seeds
}

// FuzzClientConn feeds a client connection arbitrary bytes after the preface, then a PING.
func FuzzClientConn(f *testing.F) {
	for _, s := range clientSeeds() {
		f.Add(s)
	}
	log.SetOutput(io.Discard) // what the front says of each broken input
	ok := func(w http.ResponseWriter, r *http.Request) { readMsg(r); grpcReply(w, []byte("ok"), nil) }
	fr, _ := startFrontWith(f, upstreamServer(f, ok, 1<<20), upstreamServer(f, ok, 1<<20), nil)
	fr.learn(containerID, "abc")
	f.Fuzz(func(t *testing.T, data []byte) { clientConnCase(t, fr, data) })
}

func clientConnCase(t *testing.T, fr *front, data []byte) {
	{
		cl, sv := net.Pipe()
		defer cl.Close()
		fr.conns.Add(1)
		served := make(chan struct{})
		go func() { fr.serveConn(sv); close(served) }()

		limit := int64(64<<10 + 64*len(data)) // what the input can call for, at most
		var (
			got    counted
			acked  = make(chan struct{})
			closed atomic.Bool
			bad    error
		)
		got.r = cl
		read := make(chan struct{})
		go func() { // the front's output: well-formed frames, bounded
			defer close(read)
			out := http2.NewFramer(io.Discard, &got)
			out.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
			out.SetMaxReadFrameSize(maxFrameLimit)
			once := sync.Once{}
			for {
				f, err := out.ReadFrame()
				if got.n > limit {
					bad = errors.New("output beyond its bound")
					return
				}
				if err != nil {
					if !closed.Load() && !errors.Is(err, io.EOF) {
						bad = err
					}
					return
				}
				if p, ok := f.(*http2.PingFrame); ok && p.IsAck() && p.Data == [8]byte{'e', 'n', 'd'} {
					once.Do(func() { close(acked) })
				}
			}
		}()
		end := newFrames()
		end.fr.WritePing(false, [8]byte{'e', 'n', 'd'})
		cl.SetWriteDeadline(time.Now().Add(2 * time.Second))
		if _, err := cl.Write(append(append([]byte(clientPreface), data...), end.b.Bytes()...)); err == nil {
			select {
			case <-acked: // the front has read it all: a moment for the replies
				time.Sleep(time.Millisecond)
			case <-read:
			case <-time.After(3 * time.Millisecond): // the PING went into another frame: bytes that
				// end any frame (at most 16384 bytes long) and then break the protocol
				cl.Write(make([]byte, defaultMaxFrame+2*9))
				select {
				case <-acked:
				case <-read:
				case <-time.After(time.Second):
				}
			}
		}
		closed.Store(true)
		cl.Close()
		select {
		case <-served:
		case <-time.After(5 * time.Second):
			t.Fatal("the connection's read loop does not end")
		}
		<-read
		if bad != nil {
			t.Fatalf("%v after %d bytes (bound %d)", bad, got.n, limit)
		}
		for i := 0; fr.budget.used.Load() != 0; i++ { // all it held is given back
			if i == 200 {
				t.Fatalf("%d bytes still held after the connection's end", fr.budget.used.Load())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// sinkRecord is a call's sink that records how the call ended.
type sinkRecord struct {
	mu       sync.Mutex
	ended    bool
	failures int
	done     chan struct{}
}

func (s *sinkRecord) headers(_ []hpack.HeaderField, end bool) {
	if end {
		s.end(false)
	}
}

func (s *sinkRecord) data(_ []byte, end bool) {
	if end {
		s.end(false)
	}
}

func (s *sinkRecord) failed(error) { s.end(true) }

func (s *sinkRecord) end(failed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if failed {
		s.failures++
	}
	if !s.ended {
		s.ended = true
		close(s.done)
	}
}

// upstreamSeeds are replies to calls 1, 3 and 5 (after the server's SETTINGS).
func upstreamSeeds() [][]byte {
	f := newFrames()
	f.fr.WriteSettings()
	hdr := f.block([][2]string{{":status", "200"}, {"content-type", "application/grpc"}})
	f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hdr, EndHeaders: true})
	f.fr.WriteData(1, false, grpcBody([]byte("reply")))
	f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: f.block([][2]string{{"grpc-status", "0"}}), EndHeaders: true, EndStream: true})
	f.fr.WriteRSTStream(3, http2.ErrCodeInternal)
	f.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 5, BlockFragment: hdr[:2]})
	f.fr.WriteContinuation(5, true, hdr[2:])
	f.fr.WriteWindowUpdate(0, 100)
	f.fr.WriteGoAway(3, http2.ErrCodeNo, nil)
	one := append([]byte(nil), f.b.Bytes()...)
	g := newFrames()
	g.fr.WriteSettings(http2.Setting{ID: http2.SettingMaxFrameSize, Val: 0})
	g.fr.WritePing(false, [8]byte{})
	return [][]byte{one, g.b.Bytes()}
}

// FuzzUpstreamConn feeds an upstream connection arbitrary bytes while three calls wait on it:
// each call gets its end or its failure, once, when the connection ends.
func FuzzUpstreamConn(f *testing.F) {
	for _, s := range upstreamSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		ours, theirs := net.Pipe()
		defer theirs.Close()
		go io.Copy(io.Discard, theirs) // the upstream reads all the front sends
		u := &upstream{name: "fuzz", addr: "/nonexistent/none.sock"}
		uc := &upConn{conn: newConn(ours, upstreamOut), up: u, nextID: 1, calls: map[uint32]*call{}}
		if err := uc.handshake(false); err != nil {
			t.Fatal(err)
		}
		u.cur = uc
		go uc.readLoop()
		var sinks []*sinkRecord
		for i := 0; i < 3; i++ {
			s := &sinkRecord{done: make(chan struct{})}
			sinks = append(sinks, s)
			u.start(okHeaders(), grpcBody([]byte("request")), s)
		}
		theirs.SetWriteDeadline(time.Now().Add(time.Second))
		theirs.Write(data)
		theirs.Close()
		for i, s := range sinks {
			select {
			case <-s.done:
			case <-time.After(5 * time.Second):
				t.Fatalf("call %d has no end after its connection's", i)
			}
			s.mu.Lock()
			n := s.failures
			s.mu.Unlock()
			if n > 1 {
				t.Fatalf("call %d failed %d times", i, n)
			}
		}
		select {
		case <-uc.w.done:
		case <-time.After(5 * time.Second):
			t.Fatal("the connection's writer does not end")
		}
	})
}

// FuzzListsChannel feeds the list channel arbitrary bytes from the shim while two lists wait.
func FuzzListsChannel(f *testing.F) {
	var seed bytes.Buffer
	seed.Write([]byte{0, 0, 0, 13, 0, 0, 0, 0, listsGeneration, 0, 0, 0, 0, 0, 0, 0, 7})
	seed.Write([]byte{0, 0, 0, 8, 0, 0, 0, 1, listsReplyOK, 0x0a, 1, 'x'})
	seed.Write([]byte{0, 0, 0, 7, 0, 0, 0, 2, listsReplyError, 14, 'e'})
	f.Add(seed.Bytes())
	f.Fuzz(func(t *testing.T, data []byte) {
		ours, theirs := net.Pipe()
		defer theirs.Close()
		go io.Copy(io.Discard, theirs)
		var generations atomic.Int64
		l := newLocalLists(ours, func(uint64) { generations.Add(1) })
		answered := make(chan int, 2)
		for i := 0; i < 2; i++ {
			var n atomic.Int64
			if !l.ask(runtimeService+"ListPodSandbox", nil, func(listed) {
				if n.Add(1) > 1 {
					t.Errorf("list %d answered twice", i)
				}
				answered <- i
			}) {
				t.Fatal("the channel is up")
			}
		}
		theirs.SetWriteDeadline(time.Now().Add(time.Second))
		theirs.Write(data)
		theirs.Close()
		for i := 0; i < 2; i++ {
			select {
			case <-answered:
			case <-time.After(5 * time.Second):
				t.Fatal("a list has no answer after its channel's end")
			}
		}
	})
}
