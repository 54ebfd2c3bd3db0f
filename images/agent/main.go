// vmsandbox-agent: the guest side of the host <-> guest channel (protocol: images/README.md).
//
// It opens the virtio-serial port named io.vmsandbox.agent.0 once, greets the host with hello
// until acked, and answers requests. Container state lives here, not in the connection: a host
// that goes away and comes back finds its containers as it left them.
package main

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

const channelName = "io.vmsandbox.agent.0"

// maxLine is the longest line the agent reads from the host, its '\n' included: a volume_write of
// 384 KiB of file data (512 KiB in base64) or an OCI spec with many environment variables fits.
const maxLine = 1 << 20

// errLineTooLong: the host sent a line longer than maxLine (skipped to its end and refused).
var errLineTooLong = errors.New("message longer than the agent reads")

// protocolVersion is what this agent sends; it also reads requests of every earlier version. Version 4:
// `create` with `tty` gives the container a terminal (before, it only joined stderr to stdout),
// and attach_resize. Version 5: personalize (a guest restored from a snapshot). Version 6: the
// volume_* ops (copies of the kubelet's atomic-writer volumes, volumes.go). Version 7: `create`
// takes image_mounts (image volumes, containers.go).
// Version 8: `create` of a container whose spec has a user namespace idmaps its root file system with
// its mappings (userns.go). Version 9: cpus_online (a resize into the pod's vCPU headroom, cpus.go).
const protocolVersion = 9

// instance names this agent process: random, made at start and reported in hello and report, so
// that the host tells an agent that restarted (and lost its containers) from one it reconnects to.
// A guest restored from a snapshot gets a new one from personalize (every clone saved the same).
var (
	instance   = newInstance()
	instanceMu sync.Mutex
)

func currentInstance() string {
	instanceMu.Lock()
	defer instanceMu.Unlock()
	return instance
}

func newInstance() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		// no randomness: the time still differs between two starts of the agent
		return fmt.Sprintf("%032x", time.Now().UnixNano())
	}
	return hex.EncodeToString(b)
}

// errUnknownContainer is the error of ops on an id the agent has no container for; its failure
// response carries the code "unknown_container", which the host acts on.
type errUnknownContainer struct{ id string }

func (e errUnknownContainer) Error() string { return fmt.Sprintf("no container %q", e.id) }

type message struct {
	V    int             `json:"v"`
	Type string          `json:"type"`
	ID   json.RawMessage `json:"id,omitempty"`
	Op   string          `json:"op,omitempty"`
	Args json.RawMessage `json:"args,omitempty"`
}

type port struct {
	f     *os.File
	wmu   sync.Mutex
	acked bool
	amu   sync.Mutex
	// unacked gets a token when acked turns false (the host went away): greet waits on it, not
	// on a timer, while a host is there
	unacked chan struct{}
	// host gets a token each time the kernel signals the port (SIGIO): a host connected or went
	// away, or data arrived. A read that found no host waits on it instead of polling, so a host
	// that connects (a restored guest's first one above all) is answered at once.
	host <-chan os.Signal
}

// hostWait is the longest a read that found no host waits for the port's signal before it tries
// again (a signal can be missed: one that came before the wait is what the channel holds, no more).
const hostWait = 100 * time.Millisecond

// watchHost asks the kernel for SIGIO on the port (O_ASYNC, owned by this process): virtio_console
// sends it when the host side opens or closes the port and when data arrives.
func watchHost(f *os.File) <-chan os.Signal {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGIO)
	rc, err := f.SyscallConn()
	if err != nil {
		logf("no SIGIO on the port (it is polled): %v", err)
		return ch
	}
	rc.Control(func(fd uintptr) {
		if _, _, e := syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_SETOWN, uintptr(os.Getpid())); e != 0 {
			logf("F_SETOWN on the port (it is polled): %v", e)
			return
		}
		flags, _, e := syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_GETFL, 0)
		if e == 0 {
			_, _, e = syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_SETFL, flags|syscall.O_ASYNC)
		}
		if e != 0 {
			logf("O_ASYNC on the port (it is polled): %v", e)
		}
	})
	return ch
}

func (p *port) send(obj map[string]interface{}) {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.writeLocked(obj)
}

// helloBuilt, when set (tests), runs after sendHello built its hello, before writing it.
var helloBuilt func()

// sendHello writes a hello unless a host has acked us, and builds it only then, under the write
// lock: a hello must not follow a response to a host that has acked us (it would tell the host the
// agent started over), nor carry an instance older than a response written before it. A hello
// built before the lock (as a restored guest's greeter did, slowly, while a personalize request
// gave the agent its new instance and its host went away) reached the next host with the
// snapshot's instance, which it took for an agent that had started over.
func (p *port) sendHello() {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	if p.isAcked() {
		return
	}
	hello := helloMessage()
	if helloBuilt != nil {
		helloBuilt()
	}
	p.writeLocked(hello)
}

func (p *port) writeLocked(obj map[string]interface{}) {
	obj["v"] = protocolVersion
	b, err := json.Marshal(obj)
	if err != nil {
		logf("cannot encode a message: %v", err)
		return
	}
	b = append(b, '\n')
	if _, err := p.f.Write(b); err != nil {
		logf("write to the channel failed: %v", err)
	}
}

// sendExec writes the response to an exec as it encodes it (execBody), under the write lock.
func (p *port) sendExec(id json.RawMessage, body *execBody) {
	head, err := json.Marshal(map[string]interface{}{"v": protocolVersion, "type": "response", "id": id, "ok": true})
	if err != nil {
		logf("cannot encode a message: %v", err)
		return
	}
	p.wmu.Lock()
	defer p.wmu.Unlock()
	w := bufio.NewWriterSize(p.f, 64<<10)
	w.Write(head[:len(head)-1]) // without its closing brace
	w.WriteString(`,"body":`)
	err = body.writeTo(w)
	if err == nil {
		w.WriteString("}\n")
		err = w.Flush()
	}
	if err != nil {
		logf("write to the channel failed: %v", err)
	}
}

func (p *port) setAcked(v bool) {
	p.amu.Lock()
	was := p.acked
	p.acked = v
	p.amu.Unlock()
	if was && !v {
		select {
		case p.unacked <- struct{}{}:
		default: // a token is there already
		}
	}
}

func (p *port) isAcked() bool {
	p.amu.Lock()
	defer p.amu.Unlock()
	return p.acked
}

func logf(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "vmsandbox-agent: "+format+"\n", a...)
}

func findPort() string {
	for waited := 0; ; waited++ {
		names, _ := filepath.Glob("/sys/class/virtio-ports/vport*/name")
		for _, nf := range names {
			b, err := os.ReadFile(nf)
			if err != nil || strings.TrimSpace(string(b)) != channelName {
				continue
			}
			dev := "/dev/" + filepath.Base(filepath.Dir(nf))
			if st, err := os.Stat(dev); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				return dev
			}
		}
		if waited%1000 == 999 {
			logf("still no virtio-serial port named %s", channelName)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func main() {
	if len(os.Args) == 2 && os.Args[1] == holdArg {
		holdUserns() // a child that only holds a user namespace open (userns.go)
	}
	// Containers are reparented to us when crun exits, so that we can wait for them.
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, 36 /* PR_SET_CHILD_SUBREAPER */, 1, 0); errno != 0 {
		logf("PR_SET_CHILD_SUBREAPER: %v", errno)
	}
	startReaper()
	dev := findPort()
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		logf("cannot open %s: %v", dev, err)
		os.Exit(1)
	}
	logf("agent %s on %s", currentInstance(), dev)
	p := &port{f: f, host: watchHost(f), unacked: make(chan struct{}, 1)}
	go p.greet()
	p.serve()
}

// greet sends hello every second while no host has acked (or sent anything), and sleeps until
// the host goes away while one has: an idle guest's agent does not wake for it.
func (p *port) greet() {
	for {
		if p.isAcked() {
			<-p.unacked
			continue
		}
		p.sendHello()
		time.Sleep(time.Second)
	}
}

func helloMessage() map[string]interface{} {
	return map[string]interface{}{"type": "hello", "body": report()}
}

func (p *port) serve() {
	r := bufio.NewReaderSize(p.f, 65536)
	for {
		line, err := readLine(r)
		if err == errLineTooLong {
			p.fail(nil, fmt.Sprintf("%v (%d bytes)", err, maxLine))
			continue
		}
		if err != nil {
			// EOF: the host went away; greet whoever connects next. A read on a port
			// without a host returns EOF at once, so do not spin: wait for the port's signal.
			p.setAcked(false)
			releaseAllLeases() // nobody reads the streamed processes of a host that went away
			select {
			case <-p.host:
			case <-time.After(hostWait):
			}
			r.Reset(p.f)
			continue
		}
		text := strings.TrimSpace(string(line))
		if text == "" {
			continue
		}
		var m message
		if err := json.Unmarshal([]byte(text), &m); err != nil {
			p.fail(nil, "unparsable message: "+err.Error())
			continue
		}
		id := m.ID
		if len(id) == 0 || id[0] != '"' {
			id = nil
		}
		if m.V < 1 || m.V > protocolVersion {
			p.fail(id, fmt.Sprintf("unsupported protocol version %d (this agent speaks 1 to %d)", m.V, protocolVersion))
			continue
		}
		switch m.Type {
		case "ack":
			p.setAcked(true)
			continue
		case "request":
		default:
			p.fail(id, "unexpected message type from the host: "+m.Type)
			continue
		}
		p.setAcked(true)
		if id == nil {
			p.fail(nil, "request without a string id")
			continue
		}
		go p.handle(id, m.Op, m.Args)
	}
}

// readLine returns the next line with its '\n', at most maxLine bytes: a line longer than r's buffer
// is gathered in a slice of its own (only a long line costs the memory); a longer one than maxLine
// is skipped to its end and errLineTooLong returned. At the end of the input, what was read of an
// unended line is returned with the reader's error.
func readLine(r *bufio.Reader) ([]byte, error) {
	line, err := r.ReadSlice('\n')
	if err != bufio.ErrBufferFull {
		return line, err
	}
	long := append([]byte(nil), line...)
	for err == bufio.ErrBufferFull {
		line, err = r.ReadSlice('\n')
		if len(long)+len(line) > maxLine {
			for err == bufio.ErrBufferFull {
				_, err = r.ReadSlice('\n')
			}
			if err != nil {
				return nil, err
			}
			return nil, errLineTooLong
		}
		long = append(long, line...)
	}
	return long, err
}

func (p *port) fail(id json.RawMessage, msg string) {
	p.failCode(id, "", msg)
}

func (p *port) failCode(id json.RawMessage, code, msg string) {
	var rid interface{}
	if id != nil {
		rid = id
	}
	resp := map[string]interface{}{"type": "response", "id": rid, "ok": false, "error": msg}
	if code != "" {
		resp["code"] = code
	}
	p.send(resp)
}

func (p *port) handle(id json.RawMessage, op string, args json.RawMessage) {
	if p.answer(id, op, args) && op == "poweroff" {
		time.Sleep(100 * time.Millisecond)
		syscall.Sync()
		syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF)
	}
}

// answer runs op and writes its response; true when the op succeeded.
func (p *port) answer(id json.RawMessage, op string, args json.RawMessage) bool {
	if len(args) == 0 || string(args) == "null" {
		args = json.RawMessage("{}")
	}
	h, ok := handlers[op]
	if !ok {
		p.fail(id, "unknown op: "+op)
		return false
	}
	body, err := h(args)
	if err != nil {
		var unknown errUnknownContainer
		if errors.As(err, &unknown) {
			p.failCode(id, "unknown_container", err.Error())
		} else {
			p.fail(id, err.Error())
		}
		return false
	}
	if eb, ok := body.(*execBody); ok {
		p.sendExec(id, eb)
		return true
	}
	if body == nil {
		body = map[string]interface{}{}
	}
	p.send(map[string]interface{}{"type": "response", "id": id, "ok": true, "body": body})
	return true
}

type handler func(args json.RawMessage) (interface{}, error)

var handlers = map[string]handler{}

func init() {
	handlers["ping"] = func(json.RawMessage) (interface{}, error) { return nil, nil }
	handlers["report"] = func(json.RawMessage) (interface{}, error) { return report(), nil }
	handlers["poweroff"] = func(json.RawMessage) (interface{}, error) { return nil, nil }
}
