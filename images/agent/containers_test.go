package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A container whose create has not answered is in no list, and an op on it waits for its create.
func TestContainerUnderCreationIsNotYetThere(t *testing.T) {
	c := &container{ID: "making", State: "creating", done: make(chan struct{}), made: make(chan struct{})}
	cmu.Lock()
	containers[c.ID] = c
	cmu.Unlock()
	defer func() { cmu.Lock(); delete(containers, c.ID); cmu.Unlock() }()

	body, err := opList(nil)
	if err != nil {
		t.Fatal(err)
	}
	listed := body.(map[string]interface{})["containers"].([]container)
	for i := range listed {
		if listed[i].ID == c.ID {
			t.Fatalf("list shows a container under creation (%s)", listed[i].State)
		}
	}
	answered := make(chan string, 1)
	go func() {
		s, err := opStatus(json.RawMessage(`{"id":"making"}`))
		if err != nil {
			answered <- err.Error()
			return
		}
		answered <- s.(container).State
	}()
	select {
	case s := <-answered:
		t.Fatalf("status answered before the create did: %s", s)
	case <-time.After(100 * time.Millisecond):
	}
	cmu.Lock()
	c.State = "created"
	cmu.Unlock()
	close(c.made)
	select {
	case s := <-answered:
		if s != "created" {
			t.Fatalf("status once created: %s", s)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("status did not answer once the create had")
	}
}

func TestResolveInTreeKeepsSymlinksInsideTheTree(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "data/sub"), 0o755))
	must(os.WriteFile(filepath.Join(root, "data/sub/f"), []byte("x"), 0o644))
	must(os.WriteFile(filepath.Join(root, "etc-file"), []byte("x"), 0o644))
	must(os.WriteFile(filepath.Join(outside, "secret"), []byte("x"), 0o644))
	must(os.Symlink("/data", filepath.Join(root, "abs")))                    // absolute: starts again at the tree's root
	must(os.Symlink("../../../../data/sub", filepath.Join(root, "data/up"))) // '..' stops at the tree's root
	must(os.Symlink(outside, filepath.Join(root, "out")))                    // would leave the tree: resolved inside it
	must(os.Symlink("loop", filepath.Join(root, "loop")))
	for _, tc := range []struct{ sub, want, err string }{
		{"", root, ""},
		{"data", root + "/data", ""},
		{"./data//sub/", root + "/data/sub", ""},
		{"abs/sub/f", root + "/data/sub/f", ""},
		{"data/up/f", root + "/data/sub/f", ""},
		{"out/secret", "", "no such file"},
		{"loop", "", "more than 40 symlinks"},
		{"data/../etc-file", "", "leaves the image"},
		{"/data", "", "not relative"},
		{"etc-file/x", "", "not a directory"},
		{"missing", "", "no such file"},
	} {
		got, err := resolveInTree(root, tc.sub)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("resolveInTree(%q) = %q, %v; want an error with %q", tc.sub, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("resolveInTree(%q) = %q, %v; want %q", tc.sub, got, err, tc.want)
		}
	}
}

func TestSetImageMountsSetsTheOneBindAtItsDestination(t *testing.T) {
	spec := map[string]interface{}{"mounts": []interface{}{
		map[string]interface{}{"destination": "/proc", "type": "proc", "source": "proc"},
		map[string]interface{}{"destination": "/v", "type": "bind", "source": "/x"},
	}}
	for _, tc := range []struct {
		m   imageMount
		err string
	}{
		{imageMount{Destination: "/v", Serial: "BAD!"}, "bad disk serial"},
		{imageMount{Destination: "v", Serial: "abc"}, "not absolute"},
	} {
		if err := setImageMounts(spec, []imageMount{tc.m}); err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("setImageMounts(%+v) = %v; want an error with %q", tc.m, err, tc.err)
		}
	}
}
