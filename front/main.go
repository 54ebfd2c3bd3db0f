// vmsandbox-front is the CRI socket's first reader when vmsandbox sits in front of a downstream
// runtime: the calls the kubelet makes all the time for ordinary pods (their status and stats by
// id, the pod and container lists, Version) are answered without a Python gRPC hop; everything
// else is relayed to the shim (python -m shim serve), which stays the one place routing is
// decided and state is held. The shim starts it with the listening socket as a descriptor and
// its standard input as a pipe: the front exits when the pipe closes, so it never outlives the
// shim. What any one client can make it hold or do is bounded (limits.go, server.go, conn.go,
// guard.go), and no peer's socket can hold a loop that serves others (writer.go).
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"strings"
	"time"
)

func main() {
	listenFD := flag.Int("listen-fd", 3, "descriptor of the listening unix socket")
	shim := flag.String("shim", "", "the shim's own unix socket")
	downstream := flag.String("downstream", "", "the downstream runtime's endpoint (unix:// or a path)")
	listsFD := flag.Int("lists-fd", -1, "descriptor of the shim's list channel (a connected unix socket); -1: none")
	timeout := flag.Float64("downstream-timeout", 10, "seconds a call sent straight to the downstream may take")
	maxConns := flag.Int("max-conns", defaultMaxConns, "client connections at once; one more is refused (GOAWAY)")
	maxBuffered := flag.Int("max-buffered-mib", defaultMaxBuffered>>20,
		"MiB the front holds for all clients at once: requests, replies collected whole, replies waiting for a client")
	windowTimeout := flag.Float64("window-timeout", defaultWindowTimeout.Seconds(),
		"seconds a reply may wait for its client's flow-control window; then its stream is reset")
	idleTimeout := flag.Float64("idle-timeout", defaultIdleTimeout.Seconds(),
		"seconds a client connection may go without an open stream or a frame; then GOAWAY and closed")
	handshakeTimeout := flag.Float64("handshake-timeout", defaultHandshakeTimeout.Seconds(),
		"seconds a client connection may take to send its preface and SETTINGS; then closed")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("vmsandbox-front: ")
	if *shim == "" || *downstream == "" || *timeout <= 0 || *maxConns <= 0 || *maxBuffered <= 0 ||
		*windowTimeout <= 0 || *idleTimeout <= 0 || *handshakeTimeout <= 0 {
		fmt.Fprintln(os.Stderr, "usage: vmsandbox-front -listen-fd N -shim PATH -downstream ENDPOINT [-downstream-timeout S] "+
			"[-max-conns N] [-max-buffered-mib M] [-window-timeout S] [-idle-timeout S] [-handshake-timeout S]")
		os.Exit(2)
	}
	ln, err := net.FileListener(os.NewFile(uintptr(*listenFD), "listener"))
	if err != nil {
		log.Fatalf("descriptor %d is not a listening socket: %v", *listenFD, err)
	}
	f := newFront(
		&upstream{name: "vmsandbox shim", addr: *shim},
		&upstream{name: *downstream, addr: strings.TrimPrefix(*downstream, "unix://")},
		seconds(*timeout),
	)
	f.maxConns = *maxConns
	f.budget = newBudget(int64(*maxBuffered) << 20)
	f.windowTimeout = seconds(*windowTimeout)
	f.idleTimeout = seconds(*idleTimeout)
	f.handshakeTimeout = seconds(*handshakeTimeout)
	if *listsFD >= 0 {
		nc, err := net.FileConn(os.NewFile(uintptr(*listsFD), "lists"))
		if err != nil {
			log.Fatalf("descriptor %d is not a connected socket: %v", *listsFD, err)
		}
		f.lists = newLocalLists(nc, f.setGeneration)
	}
	go func() { // the shim's end of the pipe: closed when the shim is gone
		_, _ = io.Copy(io.Discard, os.Stdin)
		os.Exit(0)
	}()
	log.Fatalf("accept: %v", f.accept(ln))
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
