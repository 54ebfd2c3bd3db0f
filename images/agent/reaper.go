package main

// The agent is a child subreaper: containers are reparented to it when crun exits, and so is a
// process run by `crun exec` whose crun died (killed on an exec timeout). A zombie nobody waits
// for inside a container's PID namespace keeps that namespace's init from finishing its exit, so
// such orphans are reaped here. Processes someone else waits for (a container's init: watch;
// commands run with os/exec: their Wait) are tracked and left alone.

import (
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

var reap struct {
	sync.Mutex
	tracked  map[int]bool
	creating int // creates in flight: their container's pid is not known (tracked) yet
}

func track(pid int) {
	reap.Lock()
	if reap.tracked == nil {
		reap.tracked = map[int]bool{}
	}
	reap.tracked[pid] = true
	reap.Unlock()
}

func untrack(pid int) {
	reap.Lock()
	delete(reap.tracked, pid)
	reap.Unlock()
}

// runTracked runs cmd to completion, keeping the reaper off it.
func runTracked(cmd *exec.Cmd) error {
	if err := startTracked(cmd); err != nil {
		return err
	}
	return waitTracked(cmd)
}

func startTracked(cmd *exec.Cmd) error {
	reap.Lock()
	reap.creating++ // no reaping until its pid is tracked
	reap.Unlock()
	err := cmd.Start()
	if err == nil {
		track(cmd.Process.Pid)
	}
	reap.Lock()
	reap.creating--
	reap.Unlock()
	return err
}

func waitTracked(cmd *exec.Cmd) error {
	err := cmd.Wait()
	untrack(cmd.Process.Pid)
	return err
}

// reapOrphans reaps the zombies reparented to the agent that nobody else waits for. It answers
// whether it left one because a create was in flight (the new container's pid is not tracked yet,
// so the zombie may be it): that one is looked at again after reapRetry.
func reapOrphans() (deferred bool) {
	self := os.Getpid()
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 2 || f[0] != "Z" {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(path)))
		if ppid != self || pid == 0 {
			continue
		}
		reap.Lock()
		owned, creating := reap.tracked[pid], reap.creating > 0
		reap.Unlock()
		if owned {
			continue
		}
		if creating {
			deferred = true
			continue
		}
		var ws syscall.WaitStatus
		syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
	}
	return deferred
}

// reapRetry: how soon a zombie left while a create was in flight is looked at again.
const reapRetry = 200 * time.Millisecond

// startReaper reaps at each SIGCHLD, and again after reapRetry while a zombie was left for a
// create in flight; an idle guest's agent wakes for neither (a scan of /proc, each wake of an
// emulated guest, costs the host CPU).
func startReaper() {
	ch := make(chan os.Signal, 8)
	signal.Notify(ch, syscall.SIGCHLD)
	go func() {
		var retry <-chan time.Time // nil (never ready) unless a zombie waits for a create
		for {
			select {
			case <-ch:
			case <-retry:
			}
			retry = nil
			if reapOrphans() {
				retry = time.After(reapRetry)
			}
		}
	}()
}
