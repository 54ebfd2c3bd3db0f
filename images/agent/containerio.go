package main

// The stdio of a container's process, set up around `crun create`: pipes (stdout, stderr, and
// stdin when asked for), or a terminal, which crun makes for the container and whose master it
// hands over a console socket (SCM_RIGHTS), as containerd's shims take it from runc.

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

type masterResult struct {
	f   *os.File
	err error
}

type containerIO struct {
	outR, errR, stdinW *os.File   // our ends of the pipes
	child              []*os.File // crun's ends, closed once create returned
	listener           *net.UnixListener
	sock               string
	got                chan masterResult
	master             *os.File
}

func (x *containerIO) pipes(cmd *exec.Cmd, stdin bool) error {
	outR, outW, err := os.Pipe()
	if err != nil {
		return err
	}
	x.outR, cmd.Stdout = outR, outW
	x.child = append(x.child, outW)
	errR, errW, err := os.Pipe()
	if err != nil {
		return err
	}
	x.errR, cmd.Stderr = errR, errW
	x.child = append(x.child, errW)
	if stdin {
		r, w, err := os.Pipe()
		if err != nil {
			return err
		}
		x.stdinW, cmd.Stdin = w, r
		x.child = append(x.child, r)
	}
	return nil
}

// terminal makes cmd (`crun create ... ID`) create the container's terminal and send its master
// to a console socket in dir, which a goroutine accepts on.
func (x *containerIO) terminal(cmd *exec.Cmd, dir string) error {
	x.sock = filepath.Join(dir, "console.sock")
	os.Remove(x.sock)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: x.sock, Net: "unix"})
	if err != nil {
		return fmt.Errorf("console socket: %v", err)
	}
	x.listener = l
	x.got = make(chan masterResult, 1)
	go func() { f, err := receiveMaster(l); x.got <- masterResult{f, err} }()
	n := len(cmd.Args)
	cmd.Args = append(cmd.Args[:n-1:n-1], "--console-socket", x.sock, cmd.Args[n-1])
	return nil
}

// takeMaster waits for the master crun sent while it created the container.
func (x *containerIO) takeMaster() error {
	var r masterResult
	select {
	case r = <-x.got:
	case <-time.After(10 * time.Second):
		x.listener.Close()
		r = <-x.got
	}
	x.got = nil
	x.stopListening()
	if r.err != nil {
		return fmt.Errorf("the container's terminal: %v", r.err)
	}
	x.master = r.f
	return nil
}

func (x *containerIO) stopListening() {
	if x.listener != nil {
		x.listener.Close()
		os.Remove(x.sock)
		x.listener = nil
	}
}

func (x *containerIO) closeChildEnds() {
	for _, f := range x.child {
		f.Close()
	}
	x.child = nil
}

// closeAll: the create failed; nothing of it stays open.
func (x *containerIO) closeAll() {
	x.closeChildEnds()
	x.stopListening()
	if x.got != nil { // the accepting goroutine ends once its listener is closed
		if r := <-x.got; r.f != nil {
			r.f.Close()
		}
		x.got = nil
	}
	for _, f := range []*os.File{x.outR, x.errR, x.stdinW, x.master} {
		if f != nil {
			f.Close()
		}
	}
}
