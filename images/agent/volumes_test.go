package main

import (
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

const testVolume = "0123456789abcdef0123456789abcdef"

func volumeOp(t *testing.T, h handler, args map[string]interface{}) (interface{}, error) {
	t.Helper()
	raw, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	return h(raw)
}

func mustOp(t *testing.T, h handler, args map[string]interface{}) interface{} {
	t.Helper()
	body, err := volumeOp(t, h, args)
	if err != nil {
		t.Fatal(err)
	}
	return body
}

func fileEntry(path, data string, offset int, mode uint32, gid int) map[string]interface{} {
	return map[string]interface{}{"path": path, "type": "file", "offset": offset,
		"data": base64.StdEncoding.EncodeToString([]byte(data)), "mode": mode, "uid": 0, "gid": gid}
}

// putVersion stages and commits one version whose files are files (path -> content).
func putVersion(t *testing.T, version string, dirs []string, files map[string]string, names []string) {
	t.Helper()
	begun := mustOp(t, opVolumeBegin, map[string]interface{}{"volume": testVolume, "version": version})
	if begun.(map[string]interface{})["current"] != false {
		t.Fatalf("begin of a new version: %v", begun)
	}
	var entries []interface{}
	for _, d := range dirs {
		entries = append(entries, map[string]interface{}{"path": d, "type": "dir", "mode": 0o2755, "uid": 0, "gid": 2000})
	}
	for p, data := range files {
		entries = append(entries, fileEntry(p, data, 0, 0o440, 2000))
	}
	mustOp(t, opVolumeWrite, map[string]interface{}{"volume": testVolume, "version": version, "entries": entries})
	meta := map[string]interface{}{"mode": 0o3777, "uid": 0, "gid": 2000}
	mustOp(t, opVolumeCommit, map[string]interface{}{"volume": testVolume, "version": version, "root": meta,
		"top": map[string]interface{}{"mode": 0o2755, "uid": 0, "gid": 2000}, "names": names})
}

func readVolume(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(volumesDir, testVolume, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestVolumeVersionsSwapLikeTheKubelet(t *testing.T) {
	volumesDir = t.TempDir()
	dir := filepath.Join(volumesDir, testVolume)
	putVersion(t, "..2026_11_27_10_00_00.1", []string{"sub"}, map[string]string{"greeting": "hello", "sub/x": "1"},
		[]string{"greeting", "sub"})
	if got := readVolume(t, "greeting"); got != "hello" {
		t.Fatalf("greeting = %q", got)
	}
	if got := readVolume(t, "sub/x"); got != "1" {
		t.Fatalf("sub/x = %q", got)
	}
	if target, _ := os.Readlink(filepath.Join(dir, "greeting")); target != "..data/greeting" {
		t.Fatalf("greeting links to %q", target)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(dir, "greeting"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode&0o7777 != 0o440 || st.Gid != 2000 {
		t.Fatalf("greeting mode %o gid %d, want 440 and 2000", st.Mode&0o7777, st.Gid)
	}
	if err := syscall.Stat(dir, &st); err != nil || st.Mode&0o7777 != 0o3777 {
		t.Fatalf("volume dir mode %o (%v), want 3777", st.Mode&0o7777, err)
	}
	// the same version again: current, nothing to send
	begun := mustOp(t, opVolumeBegin, map[string]interface{}{"volume": testVolume, "version": "..2026_11_27_10_00_00.1"})
	if begun.(map[string]interface{})["current"] != true {
		t.Fatalf("begin of the committed version: %v", begun)
	}
	// an update: greeting changes, sub goes, other comes
	putVersion(t, "..2026_11_27_10_01_00.2", nil, map[string]string{"greeting": "bye", "other": "o"},
		[]string{"greeting", "other"})
	if got := readVolume(t, "greeting"); got != "bye" {
		t.Fatalf("greeting after the update = %q", got)
	}
	if _, err := os.Lstat(filepath.Join(dir, "sub")); !os.IsNotExist(err) {
		t.Fatalf("sub is still there: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "..2026_11_27_10_00_00.1")); !os.IsNotExist(err) {
		t.Fatalf("the old version is still there: %v", err)
	}
	mustOp(t, opVolumeRemove, map[string]interface{}{"volume": testVolume})
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Fatalf("the volume is still there: %v", err)
	}
}

func TestVolumeFileInParts(t *testing.T) {
	volumesDir = t.TempDir()
	v := "..2026_11_27_10_00_00.3"
	mustOp(t, opVolumeBegin, map[string]interface{}{"volume": testVolume, "version": v})
	for i, part := range []string{"abc", "def"} {
		mustOp(t, opVolumeWrite, map[string]interface{}{"volume": testVolume, "version": v,
			"entries": []interface{}{fileEntry("big", part, 3*i, 0o644, 0)}})
	}
	// a part that does not follow the last is refused
	if _, err := volumeOp(t, opVolumeWrite, map[string]interface{}{"volume": testVolume, "version": v,
		"entries": []interface{}{fileEntry("big", "x", 2, 0o644, 0)}}); err == nil {
		t.Fatal("a part at the wrong offset was written")
	}
	mustOp(t, opVolumeCommit, map[string]interface{}{"volume": testVolume, "version": v, "names": []string{"big"},
		"root": map[string]interface{}{"mode": 0o755}, "top": map[string]interface{}{"mode": 0o755}})
	if got := readVolume(t, "big"); got != "abcdef" {
		t.Fatalf("big = %q", got)
	}
}

func TestVolumeOpsRefuseEscapes(t *testing.T) {
	volumesDir = t.TempDir()
	v := "..2026_11_27_10_00_00.4"
	mustOp(t, opVolumeBegin, map[string]interface{}{"volume": testVolume, "version": v})
	outside := filepath.Join(volumesDir, "outside")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	// a symlink in the staging directory is never written through
	if err := os.Symlink(outside+"/f", filepath.Join(volumesDir, testVolume, v, "link")); err != nil {
		t.Fatal(err)
	}
	cases := []map[string]interface{}{
		{"volume": "../x", "version": v},
		{"volume": testVolume, "version": "..data"},
		{"volume": testVolume, "version": "../../etc"},
		{"volume": testVolume, "version": v, "entries": []interface{}{fileEntry("../escape", "x", 0, 0o644, 0)}},
		{"volume": testVolume, "version": v, "entries": []interface{}{fileEntry("/abs", "x", 0, 0o644, 0)}},
		{"volume": testVolume, "version": v, "entries": []interface{}{fileEntry("a//b", "x", 0, 0o644, 0)}},
		{"volume": testVolume, "version": v, "entries": []interface{}{fileEntry("link", "x", 0, 0o644, 0)}},
		{"volume": testVolume, "version": v, "entries": []interface{}{fileEntry("link", "x", 1, 0o644, 0)}},
	}
	for _, c := range cases {
		if _, err := volumeOp(t, opVolumeWrite, c); err == nil {
			t.Errorf("volume_write %v succeeded", c)
		}
	}
	if _, err := os.Stat(outside + "/f"); !os.IsNotExist(err) {
		t.Fatalf("a write went through the symlink: %v", err)
	}
	for _, names := range [][]string{{"..data"}, {"a/b"}, {".."}, {""}} {
		_, err := volumeOp(t, opVolumeCommit, map[string]interface{}{"volume": testVolume, "version": v, "names": names})
		if err == nil || !strings.Contains(err.Error(), "bad name") {
			t.Errorf("commit with names %q: %v", names, err)
		}
	}
}
