package main

import (
	"os"
	"path/filepath"
	"testing"
)

func TestHotplugEvent(t *testing.T) {
	for _, tc := range []struct {
		msg  string
		want bool
	}{
		{"add@/devices/system/cpu/cpu1\x00ACTION=add\x00SUBSYSTEM=cpu", true},
		{"add@/devices/system/memory/memory32\x00ACTION=add", true},
		{"online@/devices/system/cpu/cpu1\x00ACTION=online", true},
		{"remove@/devices/system/cpu/cpu1\x00ACTION=remove", false},
		{"add@/devices/virtual/net/eth0\x00ACTION=add\x00x=/devices/system/cpu/", false},
		{"", false},
	} {
		if got := hotplugEvent([]byte(tc.msg)); got != tc.want {
			t.Errorf("hotplugEvent(%q) = %v, want %v", tc.msg, got, tc.want)
		}
	}
}

func TestOnlineHotplugged(t *testing.T) {
	root := t.TempDir()
	write := func(rel, content string) string {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cpu1 := write("devices/system/cpu/cpu1/online", "0\n")
	cpu2 := write("devices/system/cpu/cpu2/online", "1\n")
	mem := write("devices/system/memory/memory9/state", "offline\n")
	write("devices/system/memory/memory1/state", "online\n")
	if n := onlineHotplugged(root); n != 2 {
		t.Fatalf("onlined %d, want 2", n)
	}
	for p, want := range map[string]string{cpu1: "1", cpu2: "1", mem: "online"} {
		if got := firstLine(p); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}
	if n := onlineHotplugged(root); n != 0 {
		t.Errorf("second pass onlined %d, want 0", n)
	}
}
