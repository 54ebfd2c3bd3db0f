package main

import (
	"bytes"
	"testing"
	"time"
)

// protobuf bytes written out by hand: key = field<<3 | wire type
func lenField(num byte, v []byte) []byte { return append([]byte{num<<3 | 2, byte(len(v))}, v...) }

func TestStringField(t *testing.T) {
	id := []byte("abc123")
	cases := []struct {
		name string
		msg  []byte
		want string
		ok   bool
	}{
		{"empty message", nil, "", true},
		{"the id", lenField(1, id), "abc123", true},
		{"last one wins", append(lenField(1, []byte("x")), lenField(1, id)...), "abc123", true},
		{"other fields around it", append(append([]byte{2 << 3, 7}, lenField(1, id)...), 5<<3|5, 1, 2, 3, 4), "abc123", true},
		{"field 1 as a varint", []byte{1 << 3, 5}, "", false},
		{"length past the end", []byte{1<<3 | 2, 9, 'a'}, "", false},
		{"truncated varint", []byte{2 << 3, 0x80}, "", false},
		{"field number 0", []byte{0<<3 | 2, 0}, "", false},
		{"a group", []byte{1<<3 | 3}, "", false},
	}
	for _, c := range cases {
		got, ok := stringField(c.msg, 1)
		if got != c.want || ok != c.ok {
			t.Errorf("%s: got %q %v, want %q %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

func TestListFilter(t *testing.T) {
	label := lenField(4, append(lenField(1, []byte("k")), lenField(2, []byte("v"))...))
	cases := []struct {
		name                    string
		msg                     []byte
		namesID, unfiltered, ok bool
	}{
		{"no filter", nil, false, true, true},
		{"an empty filter", lenField(1, nil), false, true, true},
		{"by state", lenField(1, []byte{2 << 3, 1}), false, false, true},
		{"by label", lenField(1, label), false, false, true},
		{"by id", lenField(1, lenField(1, []byte("ab"))), true, false, true},
		{"by sandbox id", lenField(1, lenField(3, []byte("ab"))), true, false, true},
		{"an empty id", lenField(1, lenField(1, nil)), false, false, true},
		{"a malformed filter", lenField(1, []byte{1<<3 | 2, 9}), false, false, false},
	}
	for _, c := range cases {
		namesID, unfiltered, ok := listFilter(c.msg, []uint64{1, 3})
		if namesID != c.namesID || unfiltered != c.unfiltered || ok != c.ok {
			t.Errorf("%s: got %v %v %v", c.name, namesID, unfiltered, ok)
		}
	}
}

func TestGRPCFraming(t *testing.T) {
	body := grpcBody([]byte("ab"), []byte("cde"))
	if !bytes.Equal(body, []byte{0, 0, 0, 0, 5, 'a', 'b', 'c', 'd', 'e'}) {
		t.Fatalf("grpcBody: %v", body)
	}
	if msg, ok := grpcMessage(body); !ok || string(msg) != "abcde" {
		t.Fatalf("grpcMessage: %q %v", msg, ok)
	}
	for _, bad := range [][]byte{nil, {0, 0, 0, 0}, {1, 0, 0, 0, 0}, {0, 0, 0, 0, 2, 'a'}, {0, 0, 0, 0, 0, 'a'}} {
		if _, ok := grpcMessage(bad); ok {
			t.Errorf("grpcMessage(%v) accepted", bad)
		}
	}
}

func TestTimeouts(t *testing.T) {
	for v, want := range map[string]time.Duration{
		"100m": 100 * time.Millisecond, "5S": 5 * time.Second, "2M": 2 * time.Minute,
		"1H": time.Hour, "7u": 7 * time.Microsecond, "9n": 9,
	} {
		if got, ok := parseTimeout(v); !ok || got != want {
			t.Errorf("parseTimeout(%q) = %v %v", v, got, ok)
		}
	}
	for _, bad := range []string{"", "5", "S", "-1S", "5x", "123456789S"} {
		if _, ok := parseTimeout(bad); ok {
			t.Errorf("parseTimeout(%q) accepted", bad)
		}
	}
	for _, d := range []time.Duration{0, 3 * time.Microsecond, 1500 * time.Millisecond, 30 * time.Hour} {
		v := formatTimeout(d)
		got, ok := parseTimeout(v)
		if !ok || got > d && d >= time.Microsecond || len(v) > 9 {
			t.Errorf("formatTimeout(%v) = %q, read back as %v %v", d, v, got, ok)
		}
	}
}

func TestClassify(t *testing.T) {
	if m := classify(runtimeService + "ContainerStatus"); m.path != byID || m.kind != containerID {
		t.Errorf("ContainerStatus: %+v", m)
	}
	if m := classify(runtimeService + "RemovePodSandbox"); m.path != viaShim || !m.forgets || m.kind != sandboxID {
		t.Errorf("RemovePodSandbox: %+v", m)
	}
	if m := classify(sawListPath); m.path != refused {
		t.Errorf("the internal service is not for clients: %+v", m)
	}
	if m := classify("/runtime.v1.ImageService/PullImage"); m.path != viaShim {
		t.Errorf("PullImage: %+v", m)
	}
	if readOnly(runtimeService+"CreateContainer") || !readOnly(runtimeService+"ListContainers") {
		t.Error("readOnly")
	}
}

func TestPercentEncode(t *testing.T) {
	if got := percentEncode("a b%c\né"); got != "a b%25c%0A%C3%A9" {
		t.Errorf("percentEncode: %q", got)
	}
}

func TestListsOfReadingsGoToTheShim(t *testing.T) {
	// their answers change without the records' generation moving: the shim merges them fresh
	for _, name := range []string{"ListPodSandboxStats", "ListContainerStats", "ListPodSandboxMetrics", "ListMetricDescriptors"} {
		if m := classify(runtimeService + name); m.path != viaShim {
			t.Errorf("%s: path %v, want viaShim", name, m.path)
		}
	}
}
