package main

// Forwarded TCP connections (the CRI's PortForward into a pod the host cannot reach, a
// host-network pod whose guest has QEMU's user-mode network): the agent connects to a port on the
// guest's loopback, where the pod's containers listen (they share the guest's network namespace),
// and relays bytes by request as a stream session (session.go) of one stream: the agent reads
// from the connection only while fewer than sessionBufMax bytes wait for the host, and releases
// connections of a host that went away.

import (
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"time"
)

const fwdMaxLive = 4 * procMaxLive // forwarded connections at once in this guest

var fwds = &sessions{
	idField: "conn",
	max:     fwdMaxLive,
	unknown: func(id string) error { return fmt.Errorf("no forwarded connection %q", id) },
	full:    func(n int) error { return fmt.Errorf("tcp_connect: %d forwarded connections already", n) },
	answer:  fwdAnswer,
}

func init() {
	handlers["tcp_connect"] = opTCPConnect
	fwds.register(sessionOps{read: "tcp_read", write: "tcp_write", closeInput: "tcp_close_write",
		release: "tcp_close"})
}

// fwdAnswer is tcp_read's answer: {"data" (base64),"eof"}.
func fwdAnswer(r readResult) map[string]interface{} {
	return map[string]interface{}{"data": r.out[0], "eof": r.done}
}

type fwdSource struct{ conn *net.TCPConn }

// tcp_connect: {"port"} -> {"conn"}
func opTCPConnect(raw json.RawMessage) (interface{}, error) {
	var a struct {
		Port int `json:"port"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	if a.Port <= 0 || a.Port > 65535 {
		return nil, fmt.Errorf("tcp_connect: bad port %d", a.Port)
	}
	id, err := fwds.reserve()
	if err != nil {
		return nil, err
	}
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(a.Port)), 10*time.Second)
	if err != nil {
		fwds.unreserve()
		return nil, fmt.Errorf("tcp_connect: %v", err)
	}
	s := newSession(1, 0, fwdSource{c.(*net.TCPConn)})
	fwds.add(id, s)
	go func() {
		s.pump(0, c)
		s.end(0) // the connection's end of stream, once its bytes are read
	}()
	return map[string]interface{}{"conn": id}, nil
}

// write fails only when no byte went.
func (f fwdSource) write(data []byte, deadline time.Time) (int, bool, error) {
	f.conn.SetWriteDeadline(deadline)
	n, err := f.conn.Write(data)
	if err != nil && n == 0 {
		return 0, false, err
	}
	return n, false, nil
}

// closeInput: the client sent its last byte.
func (f fwdSource) closeInput() { f.conn.CloseWrite() }

func (f fwdSource) release(s *session) {
	f.conn.Close()
	s.forget()
}
