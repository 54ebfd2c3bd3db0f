package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeCPUs makes a sysfs cpu tree under a new root: cpu0 (no online file, as on x86) and one
// cpuN/online per entry of states ("1" online, "0" offline), and the kernel's online list.
func fakeCPUs(t *testing.T, online string, states ...string) string {
	t.Helper()
	root := t.TempDir()
	write := func(rel, content string) {
		p := filepath.Join(root, "devices/system/cpu", rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("cpu0/topology/core_id", "0\n")
	for i, s := range states {
		write("cpu"+string(rune('1'+i))+"/online", s+"\n")
	}
	write("online", online+"\n")
	write("present", "0-"+string(rune('0'+len(states)))+"\n")
	return root
}

func TestCPUsOnline(t *testing.T) {
	for _, tc := range []struct {
		name   string
		states []string
		count  int
		want   []string // the cpuN/online files after, cpu1 first
		err    string
	}{
		{"one more", []string{"0", "0"}, 2, []string{"1", "0"}, ""},
		{"all", []string{"0", "0"}, 3, []string{"1", "1"}, ""},
		{"already online: nothing", []string{"1", "0"}, 2, []string{"1", "0"}, ""},
		{"never offlines", []string{"1", "1"}, 1, []string{"1", "1"}, ""},
		{"a gap is filled", []string{"0", "1", "0"}, 3, []string{"1", "1", "0"}, ""},
		{"more than present", []string{"0"}, 3, []string{"1"}, "cpu2 is not present (present: 0-1)"},
		{"zero", []string{"0"}, 0, []string{"0"}, "count must be 1 to 4096, got 0"},
		{"negative", []string{"0"}, -1, []string{"0"}, "count must be 1 to 4096"},
		{"too many", []string{"0"}, maxOnlineCPUs + 1, []string{"0"}, "count must be 1 to 4096"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := fakeCPUs(t, "0", tc.states...)
			_, err := cpusOnline(root, tc.count)
			if tc.err == "" && err != nil {
				t.Fatalf("cpusOnline: %v", err)
			}
			if tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("cpusOnline error %v, want %q", err, tc.err)
			}
			for i, want := range tc.want {
				f := filepath.Join(root, "devices/system/cpu", "cpu"+string(rune('1'+i)), "online")
				if got := firstLine(f); got != want {
					t.Errorf("cpu%d/online = %q, want %q", i+1, got, want)
				}
			}
		})
	}
}

func TestCPUsOnlineCountsTheKernelsList(t *testing.T) {
	root := fakeCPUs(t, "0-2", "1", "1")
	if n, err := cpusOnline(root, 3); err != nil || n != 3 {
		t.Fatalf("cpusOnline = %d, %v; want 3", n, err)
	}
}

func TestCPUsOnlineOp(t *testing.T) {
	for _, args := range []string{`{"count":"2"}`, `{"count":1.5}`, `[]`} {
		if _, err := opCPUsOnline([]byte(args)); err == nil || !strings.Contains(err.Error(), "bad arguments") {
			t.Errorf("cpus_online %s: %v, want bad arguments", args, err)
		}
	}
	if _, err := opCPUsOnline([]byte(`{}`)); err == nil || !strings.Contains(err.Error(), "got 0") {
		t.Errorf("cpus_online without count: %v", err)
	}
}
