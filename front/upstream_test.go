package main

// What an upstream (the shim, the downstream) may send the front, the client of its connections:
// SETTINGS a server must not send, and replies larger than the front passes on.

import (
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// RFC 9113 6.5.2: a client MUST treat SETTINGS_ENABLE_PUSH other than 0 from a server as a
// connection error of type PROTOCOL_ERROR; the front is its upstreams' client
func TestAnUpstreamThatEnablesPushIsAProtocolError(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "shim.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	goAway := make(chan http2.ErrCode, 4)
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer nc.Close()
				preface := make([]byte, len(clientPreface))
				if _, err := io.ReadFull(nc, preface); err != nil {
					return
				}
				fr := http2.NewFramer(nc, nc)
				fr.WriteSettings(http2.Setting{ID: http2.SettingEnablePush, Val: 1})
				nc.SetReadDeadline(time.Now().Add(5 * time.Second))
				for {
					f, err := fr.ReadFrame()
					if err != nil {
						return
					}
					if g, ok := f.(*http2.GoAwayFrame); ok {
						goAway <- g.ErrCode
						return
					}
				}
			}()
		}
	}()
	_, front := startFront(t, sock, filepath.Join(t.TempDir(), "none.sock"))
	r := rpc(t, h2client(front), runtimeService+"StopPodSandbox", nil, nil)
	if r.status != "14" {
		t.Fatalf("a call on an upstream that enabled push: %q %q", r.status, r.message)
	}
	select {
	case code := <-goAway:
		if code != http2.ErrCodeProtocol {
			t.Fatalf("GOAWAY %v", code)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the upstream that enabled push got no GOAWAY")
	}
}

// an upstream's reply whose header block decodes past maxHeaderList (HPACK names an indexed
// field again in one byte) fails that call alone, RESOURCE_EXHAUSTED, whether relayed frame by
// frame or collected whole; the upstream's connection goes on serving
func TestAnOversizedUpstreamReplyFailsOnlyItsCall(t *testing.T) {
	var calls atomic.Int64
	shim := upstreamServer(t, func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		readMsg(r)
		if strings.HasSuffix(r.URL.Path, "/StopPodSandbox") || strings.HasSuffix(r.URL.Path, "/Version") {
			for i := 0; i < 20; i++ { // 80 KB decoded, 4 KB sent
				w.Header().Add("X-Big", strings.Repeat("a", 4000))
			}
		}
		grpcReply(w, []byte("ok"), nil)
	}, 1<<20)
	f, sock := startFront(t, shim, filepath.Join(t.TempDir(), "none.sock"))
	c := h2client(sock)
	if r := rpc(t, c, runtimeService+"Status", nil, nil); r.status != "0" {
		t.Fatalf("Status: %q", r.status)
	}
	conn := f.shim.live()
	for _, m := range []string{"StopPodSandbox", "Version"} {
		r := rpc(t, c, runtimeService+m, nil, nil)
		if r.status != "8" || !strings.Contains(r.message, "header list larger than 65536 bytes") {
			t.Fatalf("%s with an oversized reply: %q %q", m, r.status, r.message)
		}
		if r := rpc(t, c, runtimeService+"Status", nil, nil); r.status != "0" || string(r.msg) != "ok" {
			t.Fatalf("Status after %s's oversized reply: %q %q", m, r.status, r.message)
		}
	}
	if f.shim.live() != conn {
		t.Fatal("the shim's connection was replaced")
	}
	if n := calls.Load(); n != 5 {
		t.Fatalf("the shim served %d calls", n)
	}
}
