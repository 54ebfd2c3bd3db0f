package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeSource records what the session core asks of it.
type fakeSource struct {
	mu        sync.Mutex
	written   []byte
	n         int   // bytes each write takes (-1: all)
	closed    bool  // the input is gone for good
	err       error // refuses writes
	inputEnds int
	released  int
	size      [2]int
	sizeErr   error
}

func (f *fakeSource) write(data []byte, _ time.Time) (int, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return 0, false, f.err
	}
	n := len(data)
	if f.n >= 0 && f.n < n {
		n = f.n
	}
	f.written = append(f.written, data[:n]...)
	return n, f.closed, nil
}

func (f *fakeSource) closeInput() { f.mu.Lock(); f.inputEnds++; f.mu.Unlock() }

func (f *fakeSource) release(s *session) {
	f.mu.Lock()
	f.released++
	f.mu.Unlock()
	s.forget()
}

// fakeTerminal is a fakeSource with a terminal.
type fakeTerminal struct{ *fakeSource }

func (f fakeTerminal) resize(rows, cols int) error {
	f.size = [2]int{rows, cols}
	return f.sizeErr
}

func testRegistry(max int) *sessions {
	return &sessions{
		idField: "sess",
		max:     max,
		unknown: func(id string) error { return fmt.Errorf("no session %q", id) },
		full:    func(n int) error { return fmt.Errorf("x_open: %d sessions already", n) },
		answer:  procAnswer,
	}
}

// open puts a new session of streams streams behind src in r.
func open(t *testing.T, r *sessions, streams int, src sessionSource) (string, *session) {
	t.Helper()
	id, err := r.reserve()
	if err != nil {
		t.Fatal(err)
	}
	s := newSession(streams, 0, src)
	r.add(id, s)
	return id, s
}

func args(t *testing.T, v map[string]interface{}) json.RawMessage {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func asJSON(t *testing.T, v interface{}) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func TestRegistryHoldsAtMostMaxSessionsCountingThoseBeingOpened(t *testing.T) {
	for _, tc := range []struct {
		name            string
		added, reserved int
		unreserved      int
		want            string
	}{
		{"room", 1, 0, 0, ""},
		{"full of open sessions", 3, 0, 0, "x_open: 3 sessions already"},
		{"full with opens under way", 1, 2, 0, "x_open: 3 sessions already"},
		{"a failed open gives its slot back", 1, 2, 1, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := testRegistry(3)
			for i := 0; i < tc.added; i++ {
				open(t, r, 1, &fakeSource{n: -1})
			}
			for i := 0; i < tc.reserved; i++ {
				if _, err := r.reserve(); err != nil {
					t.Fatal(err)
				}
			}
			for i := 0; i < tc.unreserved; i++ {
				r.unreserve()
			}
			_, err := r.reserve()
			if got := errText(err); got != tc.want {
				t.Fatalf("reserve: %q, want %q", got, tc.want)
			}
		})
	}
}

func TestIdsAreNotReused(t *testing.T) {
	r := testRegistry(2)
	seen := map[string]bool{}
	for i := 0; i < 10; i++ {
		id, s := open(t, r, 1, &fakeSource{n: -1})
		if seen[id] || strings.Trim(id, "0123456789") != "" {
			t.Fatalf("id %q: used before, or not a number", id)
		}
		seen[id] = true
		s.close()
	}
}

func TestLookupReadsTheKindsIdField(t *testing.T) {
	r := testRegistry(4)
	id, _ := open(t, r, 1, &fakeSource{n: -1})
	for _, tc := range []struct {
		name string
		raw  string
		want string
	}{
		{"found", `{"sess":"` + id + `"}`, ""},
		{"unknown", `{"sess":"99"}`, `no session "99"`},
		{"missing", `{}`, `no session ""`},
		{"another kind's field", `{"proc":"` + id + `"}`, `no session ""`},
		{"not a string", `{"sess":7}`, "json: cannot unmarshal number into Go struct field .sess of type string"},
		{"not an object", `[1]`, "json: cannot unmarshal array into Go value of type struct { Sess string \"json:\\\"sess\\\"\" }"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := r.lookup(json.RawMessage(tc.raw))
			if got := errText(err); got != tc.want {
				t.Fatalf("lookup(%s): %q, want %q", tc.raw, got, tc.want)
			}
		})
	}
}

func TestReadTakesAtMostMaxBytesFirstStreamFirst(t *testing.T) {
	for _, tc := range []struct {
		name             string
		out, err         string
		max              int
		wantOut, wantErr string
		restOut, restErr string
	}{
		{"all", "abc", "de", 10, "abc", "de", "", ""},
		{"stdout fills it", "abcdef", "gh", 4, "abcd", "", "ef", "gh"},
		{"room left for stderr", "ab", "cdef", 4, "ab", "cd", "", "ef"},
		{"none asked: the most", "ab", "cd", 0, "ab", "cd", "", ""},
		{"nothing there", "", "", 4, "", "", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSession(2, 0, &fakeSource{})
			s.offer(0, []byte(tc.out))
			s.offer(1, []byte(tc.err))
			r := s.read(tc.max, 0)
			if string(r.out[0]) != tc.wantOut || string(r.out[1]) != tc.wantErr || r.out[0] == nil || r.out[1] == nil {
				t.Fatalf("took %q %q, want %q %q", r.out[0], r.out[1], tc.wantOut, tc.wantErr)
			}
			if string(s.out[0].buf) != tc.restOut || string(s.out[1].buf) != tc.restErr {
				t.Fatalf("left %q %q, want %q %q", s.out[0].buf, s.out[1].buf, tc.restOut, tc.restErr)
			}
		})
	}
}

func TestFinishedOnceEndedAndDrained(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ended    bool
		eof      [2]bool
		waiting  bool // output not yet taken
		drain    time.Duration
		since    time.Duration // since the end
		finished bool
	}{
		{"running", false, [2]bool{true, true}, false, 0, 0, false},
		{"ended, every stream at its end", true, [2]bool{true, true}, false, time.Hour, 0, true},
		{"ended, output not taken", true, [2]bool{true, true}, true, 0, time.Hour, false},
		{"ended, a stream open, in the drain time", true, [2]bool{true, false}, false, time.Second, 0, false},
		{"ended, a stream open, drain time past", true, [2]bool{true, false}, false, time.Second, 2 * time.Second, true},
		{"ended, no drain time (a container's sessions)", true, [2]bool{false, false}, false, 0, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSession(2, tc.drain, &fakeSource{})
			s.ended, s.endedAt = tc.ended, time.Now().Add(-tc.since)
			s.out[0].eof, s.out[1].eof = tc.eof[0], tc.eof[1]
			if tc.waiting {
				s.out[0].buf = []byte("x")
			}
			if got := s.finishedLocked(); got != tc.finished {
				t.Fatalf("finished: %v, want %v", got, tc.finished)
			}
		})
	}
}

func TestReadWaitsForWhatComesFirst(t *testing.T) {
	for _, tc := range []struct {
		name  string
		event func(s *session)
		done  bool
		out   string
	}{
		{"output", func(s *session) { s.offer(0, []byte("hi")) }, false, "hi"},
		{"the end", func(s *session) { s.shut(0); s.end(3) }, true, ""},
		{"the release", func(s *session) { s.close() }, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSession(1, 0, &fakeSource{})
			time.AfterFunc(50*time.Millisecond, func() { tc.event(s) })
			start := time.Now()
			r := s.read(0, 10*time.Second)
			if time.Since(start) > 5*time.Second {
				t.Fatalf("read waited %v", time.Since(start))
			}
			if r.done != tc.done || string(r.out[0]) != tc.out {
				t.Fatalf("read: done %v %q, want %v %q", r.done, r.out[0], tc.done, tc.out)
			}
		})
	}
	t.Run("the timeout", func(t *testing.T) {
		s := newSession(1, 0, &fakeSource{})
		start := time.Now()
		r := s.read(0, 100*time.Millisecond)
		if d := time.Since(start); d < 100*time.Millisecond || len(r.out[0]) != 0 || r.done {
			t.Fatalf("read after %v: %+v", d, r)
		}
	})
	t.Run("the drain time after the end", func(t *testing.T) {
		s := newSession(1, 100*time.Millisecond, &fakeSource{})
		s.end(0) // the stream stays open: a descendant holds it
		start := time.Now()
		r := s.read(0, 10*time.Second)
		if d := time.Since(start); d < 100*time.Millisecond || d > 5*time.Second || !r.done {
			t.Fatalf("read after %v: %+v", d, r)
		}
	})
}

// endless gives as many bytes as asked for, and counts them.
type endless struct {
	mu sync.Mutex
	n  int
}

func (e *endless) Read(p []byte) (int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.n += len(p)
	return len(p), nil
}

func (e *endless) count() int { e.mu.Lock(); defer e.mu.Unlock(); return e.n }

func TestPumpStopsReadingWhileTheBufferIsFull(t *testing.T) {
	s := newSession(1, 0, &fakeSource{})
	src := &endless{}
	done := make(chan struct{})
	go func() { s.pump(0, src); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	for src.count() < sessionBufMax && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	if n := src.count(); n < sessionBufMax || n >= sessionBufMax+sessionReadChunk {
		t.Fatalf("%d bytes read with nobody taking them, want %d up to one chunk more", n, sessionBufMax)
	}
	before := src.count()
	if r := s.read(sessionBufMax, 0); len(r.out[0]) != before {
		t.Fatalf("took %d of %d bytes", len(r.out[0]), before)
	}
	for src.count() == before && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if src.count() == before {
		t.Fatal("the pump did not read again once there was room")
	}
	s.close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the pump went on after the release")
	}
}

func TestPumpEndsAtTheSourcesEnd(t *testing.T) {
	s := newSession(1, 0, &fakeSource{})
	s.pump(0, io.MultiReader(strings.NewReader("abc"), strings.NewReader("de")))
	if r := s.read(0, 0); string(r.out[0]) != "abcde" || !s.out[0].eof {
		t.Fatalf("read %q, eof %v", r.out[0], s.out[0].eof)
	}
}

func TestOfferDropsWhatDoesNotFit(t *testing.T) {
	for _, tc := range []struct {
		name    string
		offers  []int
		kept    int
		dropped int64
	}{
		{"fits", []int{10, 20}, 30, 0},
		{"exactly full", []int{sessionBufMax}, sessionBufMax, 0},
		{"a piece that does not fit is dropped whole", []int{sessionBufMax - 5, 10, 5}, sessionBufMax, 10},
		{"too big alone", []int{sessionBufMax + 1}, 0, sessionBufMax + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSession(2, 0, &fakeSource{})
			for _, n := range tc.offers {
				s.offer(1, make([]byte, n))
			}
			if len(s.out[1].buf) != tc.kept || s.dropped != tc.dropped {
				t.Fatalf("kept %d dropped %d, want %d %d", len(s.out[1].buf), s.dropped, tc.kept, tc.dropped)
			}
			if r := s.read(0, 0); r.dropped != tc.dropped {
				t.Fatalf("read says %d dropped", r.dropped)
			}
		})
	}
}

func TestReleaseDropsTheOutputOnceAndForgets(t *testing.T) {
	r := testRegistry(4)
	src := &fakeSource{}
	id, s := open(t, r, 2, src)
	s.offer(0, []byte("unread"))
	s.close()
	s.close()
	if src.released != 1 {
		t.Fatalf("the source was released %d times", src.released)
	}
	if _, err := r.lookup(args(t, map[string]interface{}{"sess": id})); errText(err) != fmt.Sprintf("no session %q", id) {
		t.Fatalf("lookup after the release: %v", err)
	}
	s.offer(0, []byte("late"))
	if got := s.read(0, 0); len(got.out[0]) != 0 {
		t.Fatalf("read after the release: %q", got.out[0])
	}
}

func TestWaitEnd(t *testing.T) {
	s := newSession(1, 0, &fakeSource{})
	if ended, _ := s.waitEnd(20 * time.Millisecond); ended {
		t.Fatal("ended before the end")
	}
	time.AfterFunc(20*time.Millisecond, func() { s.end(7) })
	if ended, code := s.waitEnd(10 * time.Second); !ended || code != 7 {
		t.Fatalf("waitEnd: %v %d", ended, code)
	}
	s.end(9)
	if _, code := s.waitEnd(0); code != 7 {
		t.Fatalf("a second end changed the code to %d", code)
	}
}

func TestIdleListsSessionsNoRequestTouched(t *testing.T) {
	r := testRegistry(4)
	idA, a := open(t, r, 1, &fakeSource{})
	_, b := open(t, r, 1, &fakeSource{})
	a.seen = time.Now().Add(-time.Hour)
	b.seen = time.Now().Add(-time.Hour)
	if _, err := r.lookup(args(t, map[string]interface{}{"sess": idA})); err != nil {
		t.Fatal(err)
	}
	if n := len(r.idle(time.Minute)); n != 1 {
		t.Fatalf("%d idle sessions, want 1", n)
	}
	for _, release := range r.idle(0) {
		release()
	}
	if len(r.m) != 0 {
		t.Fatalf("%d sessions left after releasing every one", len(r.m))
	}
}

func TestOps(t *testing.T) {
	big := strings.Repeat("x", sessionWriteMax+1)
	for _, tc := range []struct {
		name    string
		src     *fakeSource
		tty     bool
		op      func(r *sessions) handler
		args    map[string]interface{} // the session's id is added
		want    string                 // the answer as JSON
		wantErr string
	}{
		{"write", &fakeSource{n: -1}, false, func(r *sessions) handler { return r.opWrite("x_write") },
			map[string]interface{}{"data": []byte("hello")}, `{"written":5}`, ""},
		{"write, partly taken", &fakeSource{n: 2}, false, func(r *sessions) handler { return r.opWrite("x_write") },
			map[string]interface{}{"data": []byte("hello"), "timeout_ms": 5}, `{"written":2}`, ""},
		{"write, input gone", &fakeSource{n: 0, closed: true}, false, func(r *sessions) handler { return r.opWrite("x_write") },
			map[string]interface{}{"data": []byte("hello")}, `{"closed":true,"written":0}`, ""},
		{"write refused", &fakeSource{err: errors.New("no input")}, false, func(r *sessions) handler { return r.opWrite("x_write") },
			map[string]interface{}{"data": []byte("hello")}, "", "x_write: no input"},
		{"write too big", &fakeSource{n: -1}, false, func(r *sessions) handler { return r.opWrite("x_write") },
			map[string]interface{}{"data": []byte(big)}, "", fmt.Sprintf("x_write: %d bytes at once (at most %d)", len(big), sessionWriteMax)},
		{"write, data not base64", &fakeSource{n: -1}, false, func(r *sessions) handler { return r.opWrite("x_write") },
			map[string]interface{}{"data": "%%"}, "", "x_write: illegal base64 data at input byte 0"},
		{"read", &fakeSource{}, false, func(r *sessions) handler { return r.opRead },
			map[string]interface{}{"timeout_ms": 0}, `{"done":false,"stderr":"","stdout":""}`, ""},
		{"close input", &fakeSource{}, false, func(r *sessions) handler { return r.opCloseInput },
			nil, `null`, ""},
		{"resize", &fakeSource{}, true, func(r *sessions) handler { return r.opResize("x_resize") },
			map[string]interface{}{"rows": 24, "cols": 80}, `null`, ""},
		{"resize refused by the terminal", &fakeSource{sizeErr: errors.New("bad size 0x0")}, true,
			func(r *sessions) handler { return r.opResize("x_resize") },
			map[string]interface{}{"rows": 0, "cols": 0}, "", "x_resize: bad size 0x0"},
		{"resize without a terminal", &fakeSource{}, false, func(r *sessions) handler { return r.opResize("x_resize") },
			map[string]interface{}{"rows": 24, "cols": 80}, "", "x_resize: the session has no terminal"},
		{"resize, bad args", &fakeSource{}, true, func(r *sessions) handler { return r.opResize("x_resize") },
			map[string]interface{}{"rows": "many"}, "", "x_resize: json: cannot unmarshal string into Go struct field .rows of type int"},
		{"release", &fakeSource{}, false, func(r *sessions) handler { return r.opRelease },
			nil, `null`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := testRegistry(4)
			var src sessionSource = tc.src
			if tc.tty {
				src = fakeTerminal{tc.src}
			}
			id, _ := open(t, r, 2, src)
			a := map[string]interface{}{"sess": id}
			for k, v := range tc.args {
				a[k] = v
			}
			body, err := tc.op(r)(args(t, a))
			if errText(err) != tc.wantErr {
				t.Fatalf("error %q, want %q", errText(err), tc.wantErr)
			}
			if err == nil {
				if got := asJSON(t, body); got != tc.want {
					t.Fatalf("answer %s, want %s", got, tc.want)
				}
			}
		})
	}
}

func TestOpsOnAnUnknownSession(t *testing.T) {
	r := testRegistry(4)
	unknown := json.RawMessage(`{"sess":"5"}`)
	for name, op := range map[string]handler{"read": r.opRead, "write": r.opWrite("x_write"),
		"close input": r.opCloseInput, "resize": r.opResize("x_resize")} {
		if _, err := op(unknown); errText(err) != `no session "5"` {
			t.Errorf("%s: %v", name, err)
		}
	}
	if body, err := r.opRelease(unknown); body != nil || err != nil {
		t.Errorf("release of what is gone: %v %v", body, err)
	}
}

func TestTheOpsReachTheSource(t *testing.T) {
	r := testRegistry(4)
	src := &fakeSource{n: -1}
	id, _ := open(t, r, 2, fakeTerminal{src})
	a := func(v map[string]interface{}) json.RawMessage {
		v["sess"] = id
		return args(t, v)
	}
	r.opWrite("x_write")(a(map[string]interface{}{"data": []byte("ab")}))
	r.opWrite("x_write")(a(map[string]interface{}{"data": []byte("cd")}))
	r.opCloseInput(a(map[string]interface{}{}))
	r.opResize("x_resize")(a(map[string]interface{}{"rows": 30, "cols": 100}))
	r.opRelease(a(map[string]interface{}{}))
	r.opRelease(a(map[string]interface{}{}))
	if string(src.written) != "abcd" || src.inputEnds != 1 || src.size != [2]int{30, 100} || src.released != 1 {
		t.Fatalf("the source saw %q, %d input ends, size %v, %d releases", src.written, src.inputEnds, src.size, src.released)
	}
}

// The three kinds' read answers, as the host reads them (vmsandbox/agent_ops.py).
func TestReadAnswersOfEachKind(t *testing.T) {
	out := [][]byte{[]byte("o"), []byte("e")}
	none := [][]byte{{}, {}}
	for _, tc := range []struct {
		name   string
		answer func(readResult) map[string]interface{}
		r      readResult
		want   string
	}{
		{"proc, running", procAnswer, readResult{out: out, code: 0}, `{"done":false,"stderr":"ZQ==","stdout":"bw=="}`},
		{"proc, done", procAnswer, readResult{out: none, done: true, code: 3}, `{"done":true,"exit_code":3,"stderr":"","stdout":""}`},
		{"attach", attachAnswer, readResult{out: out, dropped: 12}, `{"done":false,"dropped_bytes":12,"stderr":"ZQ==","stdout":"bw=="}`},
		{"attach, done", attachAnswer, readResult{out: none, done: true}, `{"done":true,"dropped_bytes":0,"stderr":"","stdout":""}`},
		{"tcp", fwdAnswer, readResult{out: out[:1]}, `{"data":"bw==","eof":false}`},
		{"tcp, end of stream", fwdAnswer, readResult{out: none[:1], done: true}, `{"data":"","eof":true}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := asJSON(t, tc.answer(tc.r)); got != tc.want {
				t.Fatalf("%s, want %s", got, tc.want)
			}
		})
	}
}

// Every kind's ops are installed under their wire names, with their errors.
func TestEachKindsOps(t *testing.T) {
	for _, op := range []string{"proc_start", "proc_read", "proc_write", "proc_close_stdin", "proc_resize", "proc_wait",
		"proc_release", "attach_open", "attach_read", "attach_write", "attach_close_stdin", "attach_resize",
		"attach_release", "tcp_connect", "tcp_read", "tcp_write", "tcp_close_write", "tcp_close"} {
		if handlers[op] == nil {
			t.Errorf("no handler for %s", op)
		}
	}
	if handlers["tcp_resize"] != nil {
		t.Error("a forwarded connection has no terminal to resize")
	}
	for _, tc := range []struct {
		op, args, want string
	}{
		{"proc_read", `{"proc":"x"}`, `no streamed process "x" (it ended, or was released)`},
		{"attach_read", `{"attach":"x"}`, `no attach session "x"`},
		{"tcp_read", `{"conn":"x"}`, `no forwarded connection "x"`},
		{"tcp_connect", `{"port":0}`, "tcp_connect: bad port 0"},
	} {
		if _, err := handlers[tc.op](json.RawMessage(tc.args)); errText(err) != tc.want {
			t.Errorf("%s: %q, want %q", tc.op, errText(err), tc.want)
		}
	}
	for _, tc := range []struct {
		r    *sessions
		want string
	}{
		{procs, "proc_start: 64 streamed processes already run in this guest"},
		{attaches, "attach: 64 sessions already in this guest"},
		{fwds, "tcp_connect: 256 forwarded connections already"},
	} {
		if got := errText(tc.r.full(tc.r.max)); got != tc.want {
			t.Errorf("full: %q, want %q", got, tc.want)
		}
	}
}

// A forwarded connection relays both ways and ends with its peer's end of stream.
func TestForwardedConnection(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		b, _ := io.ReadAll(c) // until tcp_close_write
		c.Write([]byte("got " + string(b)))
		c.Close()
	}()
	body, err := handlers["tcp_connect"](args(t, map[string]interface{}{"port": l.Addr().(*net.TCPAddr).Port}))
	if err != nil {
		t.Fatal(err)
	}
	conn := body.(map[string]interface{})["conn"].(string)
	a := func(v map[string]interface{}) json.RawMessage {
		v["conn"] = conn
		return args(t, v)
	}
	if body, err := handlers["tcp_write"](a(map[string]interface{}{"data": []byte("ping")})); err != nil ||
		asJSON(t, body) != `{"written":4}` {
		t.Fatalf("tcp_write: %v %v", body, err)
	}
	handlers["tcp_close_write"](a(map[string]interface{}{}))
	var got []byte
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		body, err := handlers["tcp_read"](a(map[string]interface{}{"timeout_ms": 1000}))
		if err != nil {
			t.Fatal(err)
		}
		m := body.(map[string]interface{})
		got = append(got, m["data"].([]byte)...)
		if m["eof"] == true {
			break
		}
	}
	if string(got) != "got ping" {
		t.Fatalf("read %q", got)
	}
	handlers["tcp_close"](a(map[string]interface{}{}))
	if _, err := handlers["tcp_read"](a(map[string]interface{}{})); errText(err) != fmt.Sprintf("no forwarded connection %q", conn) {
		t.Fatalf("tcp_read after tcp_close: %v", err)
	}
}
