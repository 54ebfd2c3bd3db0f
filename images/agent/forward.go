package main

// Forwarded TCP connections (the CRI's PortForward into a pod the host cannot reach, a
// host-network pod whose guest has QEMU's user-mode network): the agent connects to a port on the
// guest's loopback, where the pod's containers listen (they share the guest's network namespace),
// and relays bytes by request. As for streamed processes, the agent reads from the connection only
// while fewer than procBufMax bytes wait for the host, and releases connections of a host that
// went away.

import (
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"
)

type fwdConn struct {
	id   string
	conn *net.TCPConn
	buf  []byte
	eof  bool
	seen time.Time
}

var fwds struct {
	sync.Mutex
	cond *sync.Cond
	m    map[string]*fwdConn
	n    int
}

func init() {
	fwds.cond = sync.NewCond(&fwds.Mutex)
	fwds.m = map[string]*fwdConn{}
	handlers["tcp_connect"] = opTCPConnect
	handlers["tcp_read"] = opTCPRead
	handlers["tcp_write"] = opTCPWrite
	handlers["tcp_close_write"] = opTCPCloseWrite
	handlers["tcp_close"] = opTCPClose
	go janitor(idleForwards)
}

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
	fwds.Lock()
	if len(fwds.m) >= 4*procMaxLive {
		fwds.Unlock()
		return nil, fmt.Errorf("tcp_connect: %d forwarded connections already", len(fwds.m))
	}
	fwds.Unlock()
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(a.Port)), 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("tcp_connect: %v", err)
	}
	fc := &fwdConn{conn: c.(*net.TCPConn), seen: time.Now()}
	fwds.Lock()
	fwds.n++
	fc.id = strconv.Itoa(fwds.n)
	fwds.m[fc.id] = fc
	fwds.Unlock()
	go fc.pump()
	return map[string]interface{}{"conn": fc.id}, nil
}

func (fc *fwdConn) pump() {
	tmp := make([]byte, procReadChunk)
	for {
		fwds.Lock()
		for len(fc.buf) >= procBufMax && !fc.eof {
			fwds.cond.Wait()
		}
		done := fc.eof
		fwds.Unlock()
		if done {
			return
		}
		n, err := fc.conn.Read(tmp)
		fwds.Lock()
		fc.buf = append(fc.buf, tmp[:n]...)
		if err != nil {
			fc.eof = true
		}
		fwds.cond.Broadcast()
		fwds.Unlock()
	}
}

func lookupFwd(raw json.RawMessage) (*fwdConn, error) {
	var a struct {
		Conn string `json:"conn"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, err
	}
	fwds.Lock()
	defer fwds.Unlock()
	fc, ok := fwds.m[a.Conn]
	if !ok {
		return nil, fmt.Errorf("no forwarded connection %q", a.Conn)
	}
	fc.seen = time.Now()
	return fc, nil
}

// tcp_read: {"conn","max_bytes","timeout_ms"} -> {"data" (base64),"eof"}
func opTCPRead(raw json.RawMessage) (interface{}, error) {
	fc, err := lookupFwd(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		MaxBytes  int `json:"max_bytes"`
		TimeoutMs int `json:"timeout_ms"`
	}
	json.Unmarshal(raw, &a)
	if a.MaxBytes <= 0 || a.MaxBytes > procBufMax {
		a.MaxBytes = procBufMax
	}
	if a.TimeoutMs < 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = procMaxPollMs
	}
	wait := time.Duration(a.TimeoutMs) * time.Millisecond
	deadline := time.Now().Add(wait)
	t := time.AfterFunc(wait, func() { fwds.Lock(); fwds.cond.Broadcast(); fwds.Unlock() })
	defer t.Stop()
	fwds.Lock()
	defer fwds.Unlock()
	for len(fc.buf) == 0 && !fc.eof && time.Now().Before(deadline) {
		fwds.cond.Wait()
	}
	n := len(fc.buf)
	if n > a.MaxBytes {
		n = a.MaxBytes
	}
	data := append([]byte(nil), fc.buf[:n]...)
	fc.buf = fc.buf[n:]
	fwds.cond.Broadcast()
	return map[string]interface{}{"data": data, "eof": fc.eof && len(fc.buf) == 0}, nil
}

// tcp_write: {"conn","data" (base64, at most procWriteMax),"timeout_ms"} -> {"written"}
func opTCPWrite(raw json.RawMessage) (interface{}, error) {
	fc, err := lookupFwd(raw)
	if err != nil {
		return nil, err
	}
	var a struct {
		Data      []byte `json:"data"`
		TimeoutMs int    `json:"timeout_ms"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("tcp_write: %v", err)
	}
	if len(a.Data) > procWriteMax {
		return nil, fmt.Errorf("tcp_write: %d bytes at once (at most %d)", len(a.Data), procWriteMax)
	}
	if a.TimeoutMs <= 0 || a.TimeoutMs > procMaxPollMs {
		a.TimeoutMs = 10000
	}
	fc.conn.SetWriteDeadline(time.Now().Add(time.Duration(a.TimeoutMs) * time.Millisecond))
	n, err := fc.conn.Write(a.Data)
	if err != nil && n == 0 {
		return nil, fmt.Errorf("tcp_write: %v", err)
	}
	return map[string]interface{}{"written": n}, nil
}

// tcp_close_write: {"conn"} -> {}: the client sent its last byte.
func opTCPCloseWrite(raw json.RawMessage) (interface{}, error) {
	fc, err := lookupFwd(raw)
	if err != nil {
		return nil, err
	}
	fc.conn.CloseWrite()
	return nil, nil
}

// tcp_close: {"conn"} -> {}
func opTCPClose(raw json.RawMessage) (interface{}, error) {
	fc, err := lookupFwd(raw)
	if err != nil {
		return nil, nil
	}
	fc.close()
	return nil, nil
}

func (fc *fwdConn) close() {
	fc.conn.Close()
	fwds.Lock()
	fc.eof = true
	fc.buf = nil
	delete(fwds.m, fc.id)
	fwds.cond.Broadcast()
	fwds.Unlock()
}
