package main

// The shim's own side of ListPodSandbox and ListContainers, asked on a channel of their own (a
// socket pair the shim hands over at start): the lists are what the kubelet asks most often, and
// a gRPC call into the shim costs several times what the answer does. A frame, either way, is a
// 4-byte big-endian length of the rest, a 4-byte request id and an op byte, then the payload:
// to the shim op 1 (ListPodSandbox) or 2 (ListContainers) and the request message; back op 0
// and the reply message, op 1 and a status code byte and a message, or op 2 and an 8-byte
// generation and the reply message: the answer holds for as long as the shim's records stay at
// that generation. Op 3 (request id 0) is the shim's newest generation, sent at start and after
// every change. While the channel is down, the lists go to the shim over gRPC instead. Requests
// are queued for the channel's own writer (writer.go): a shim that stops reading it holds no
// client, and loses the channel after writeTimeout.

import (
	"bufio"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
)

const (
	listsAskPodSandbox = 1
	listsAskContainers = 2
	listsReplyOK       = 0
	listsReplyError    = 1
	listsReplyKept     = 2
	listsGeneration    = 3

	maxListAsk    = 64 << 10 // a list request larger than this goes over gRPC
	listsQueueMax = 1 << 20  // requests queued for the shim beyond this cut the channel
)

var errListsDown = errors.New("the shim's list channel is closed")

var listsOps = map[string]byte{
	runtimeService + "ListPodSandbox": listsAskPodSandbox,
	runtimeService + "ListContainers": listsAskContainers,
}

type localLists struct {
	nc         net.Conn
	generation func(uint64) // the shim's newest generation; 0 once the channel is down

	mu      sync.Mutex // w, nextID, pending, err
	w       *peerWriter
	nextID  uint32
	pending map[uint32]func(listed)
	err     error
}

// listed is the shim's answer: a reply as collected, and the generation it holds for (0: none).
type listed struct {
	result
	generation uint64
}

func newLocalLists(nc net.Conn, generation func(uint64)) *localLists {
	l := &localLists{nc: nc, generation: generation, pending: map[uint32]func(listed){}}
	l.w = newPeerWriter(nc, &l.mu, listsQueueMax)
	l.w.start()
	go l.readLoop()
	return l
}

// ask sends a list request; done gets the shim's answer as a gRPC reply would be collected.
// False: the channel is down (done is not called).
func (l *localLists) ask(path string, msg []byte, done func(listed)) bool {
	op, ok := listsOps[path]
	if !ok || l == nil || len(msg) > maxListAsk {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil || l.w.stoppedLocked() {
		return false
	}
	l.nextID++
	id := l.nextID
	var head [9]byte
	binary.BigEndian.PutUint32(head[0:4], uint32(5+len(msg)))
	binary.BigEndian.PutUint32(head[4:8], id)
	head[8] = op
	_, _ = l.w.Write(head[:])
	_, _ = l.w.Write(msg)
	if err := l.w.kick(); err != nil {
		return false
	}
	l.pending[id] = done
	return true
}

func (l *localLists) readLoop() {
	r := bufio.NewReaderSize(l.nc, 64<<10)
	err := func() error {
		var head [9]byte
		for {
			if _, err := io.ReadFull(r, head[:]); err != nil {
				return err
			}
			n := binary.BigEndian.Uint32(head[0:4])
			if n < 5 || n-5 > maxMessage+1 {
				return errors.New("a reply frame of a bad length")
			}
			payload := make([]byte, n-5)
			if _, err := io.ReadFull(r, payload); err != nil {
				return err
			}
			id := binary.BigEndian.Uint32(head[4:8])
			if head[8] == listsGeneration {
				if id != 0 || len(payload) != 8 {
					return errors.New("a malformed generation frame")
				}
				l.generation(binary.BigEndian.Uint64(payload))
				continue
			}
			l.mu.Lock()
			done := l.pending[id]
			delete(l.pending, id)
			l.mu.Unlock()
			if done != nil {
				done(listsResult(head[8], payload))
			}
		}
	}()
	l.mu.Lock()
	l.err = err
	l.w.cutLocked()
	pending := l.pending
	l.pending = map[uint32]func(listed){}
	l.mu.Unlock()
	_ = l.nc.Close()
	l.generation(0) // nothing kept holds any more
	for _, done := range pending {
		done(listed{result: result{err: errListsDown}})
	}
}

func listsResult(op byte, payload []byte) listed {
	switch {
	case op == listsReplyOK:
		return listed{result: result{hdrs: okHeaders(), body: grpcBody(payload), trailers: okTrailers()}}
	case op == listsReplyKept && len(payload) >= 8:
		return listed{
			result:     result{hdrs: okHeaders(), body: grpcBody(payload[8:]), trailers: okTrailers()},
			generation: binary.BigEndian.Uint64(payload[:8]),
		}
	case op == listsReplyError && len(payload) >= 1:
		return listed{result: result{hdrs: statusOnly(int(payload[0]), string(payload[1:]))}}
	}
	return listed{result: result{hdrs: statusOnly(codeUnavailable, "a malformed answer on the shim's list channel")}}
}
