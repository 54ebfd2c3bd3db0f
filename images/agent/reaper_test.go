package main

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// procState is the state letter of pid in /proc ("" once the process is gone).
func procState(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ""
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return f[0]
}

func TestReaperLeavesAZombieForACreateInFlightThenReapsIt(t *testing.T) {
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, 36 /* PR_SET_CHILD_SUBREAPER */, 1, 0); errno != 0 {
		t.Skipf("PR_SET_CHILD_SUBREAPER: %v", errno)
	}
	// the shell exits at once; its background sleep is reparented to this process and ends a
	// moment later as a zombie nobody waits for
	out, err := exec.Command("sh", "-c", "sleep 0.1 & echo $!").Output()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for procState(pid) != "Z" {
		if time.Now().After(deadline) {
			t.Fatalf("pid %d not a zombie after 10 s (state %q)", pid, procState(pid))
		}
		time.Sleep(10 * time.Millisecond)
	}
	reap.Lock()
	reap.creating++ // a create in flight: the zombie may be its container, whose pid is not tracked yet
	reap.Unlock()
	if !reapOrphans() {
		t.Fatal("a zombie left for a create in flight must be looked at again")
	}
	if st := procState(pid); st != "Z" {
		t.Fatalf("the zombie was reaped during a create (state %q)", st)
	}
	reap.Lock()
	reap.creating--
	reap.Unlock()
	if reapOrphans() {
		t.Fatal("nothing is left to look at again once the create is done")
	}
	if st := procState(pid); st != "" {
		t.Fatalf("pid %d not reaped (state %q)", pid, st)
	}
}

func TestGreetSleepsWhileAHostIsThereAndGreetsWhenItGoes(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p := &port{f: w, unacked: make(chan struct{}, 1)}
	p.setAcked(true)
	go p.greet()
	buf := make([]byte, 1<<20)
	r.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
	if n, err := r.Read(buf); err == nil {
		t.Fatalf("a hello while a host is there: %q", head(buf[:n]))
	}
	p.setAcked(false) // the host went away
	r.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := r.Read(buf)
	if err != nil {
		t.Fatalf("no hello after the host went away: %v", err)
	}
	if !strings.Contains(string(buf[:n]), `"type":"hello"`) {
		t.Fatalf("not a hello: %q", head(buf[:n]))
	}
}

// head is at most the first 200 bytes of b, for a failure's message.
func head(b []byte) []byte {
	if len(b) > 200 {
		return b[:200]
	}
	return b
}
