package main

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// A stand-in for crun exec: its process (a long sleep, sharing the output) starts at once, and its
// pid reaches the pid file only later, as a slow crun on a loaded guest writes it.
func slowCrun(t *testing.T, pidFile string) (*exec.Cmd, chan error) {
	t.Helper()
	script := `(exec sleep 30) & child=$!; sleep 0.5; echo $child > "$1"; wait`
	cmd := exec.Command("sh", "-c", script, "sh", pidFile)
	var out bytes.Buffer
	cmd.Stdout = &out // a pipe: Wait returns once every holder of its write end has closed it
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return cmd, done
}

func TestATimedOutExecKillsAProcessWhosePidComesLate(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "exec.pid")
	cmd, done := slowCrun(t, pidFile)
	time.Sleep(100 * time.Millisecond) // the timeout passes before the pid file is written
	start := time.Now()
	err := stopTimedOut(cmd, pidFile, done, 5*time.Second)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("the exec answered after %v: its process outlived the timeout", took)
	}
	ee, ok := err.(*exec.ExitError)
	if !ok {
		t.Fatalf("crun's wait: %v", err)
	}
	if ws := ee.Sys().(syscall.WaitStatus); !ws.Signaled() && ws.ExitStatus() == 0 {
		t.Fatalf("crun ended cleanly: %v", ws)
	}
}

func TestATimedOutExecWhosePidNeverComesStillEnds(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "never.pid")
	cmd := exec.Command("sleep", "30") // crun stuck before it started anything
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	start := time.Now()
	if err := stopTimedOut(cmd, pidFile, done, 300*time.Millisecond); err == nil {
		t.Fatal("a killed crun answered no error")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("took %v", took)
	}
}
