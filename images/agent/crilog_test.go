package main

import (
	"fmt"
	"math/rand"
	"strings"
	"testing"
	"time"
)

// records cuts input, fed in pieces of step bytes (0: at once), into "F:text" / "P:text" records.
func records(max, step int, input string, closed bool) []string {
	l := newLogLiner(max)
	var out []string
	emit := func(partial bool, text []byte) {
		tag := "F"
		if partial {
			tag = "P"
		}
		out = append(out, tag+":"+string(text))
	}
	if step <= 0 {
		step = len(input) + 1
	}
	for i := 0; i < len(input); i += step {
		end := i + step
		if end > len(input) {
			end = len(input)
		}
		l.feed([]byte(input[i:end]), emit)
	}
	if closed {
		l.end(emit)
	}
	return out
}

func TestLogLinerCutsAsContainerdDoes(t *testing.T) {
	cases := []struct {
		name   string
		input  string
		closed bool
		want   []string
	}{
		{"one line", "hello\n", true, []string{"F:hello"}},
		{"terminal newline", "hello\r\nworld\r\n", true, []string{"F:hello", "F:world"}},
		{"empty lines", "\n\r\n", true, []string{"F:", "F:"}},
		{"carriage return inside a line is kept", "a\rb\n", true, []string{"F:a\rb"}},
		{"partial at the end", "prompt$ ", true, []string{"P:prompt$ "}},
		{"partial not yet ended", "prompt$ ", false, nil},
		{"lone carriage return at the end", "x\r", true, []string{"P:x\r"}},
		{"exactly max", "12345678\n", true, []string{"F:12345678"}},
		{"exactly max with a terminal newline", "12345678\r\n", true, []string{"F:12345678"}},
		{"one over max", "123456789\n", true, []string{"P:12345678", "F:9"}},
		{"max then carriage return kept", "12345678\rx\n", true, []string{"P:12345678", "F:\rx"}},
		{"two max pieces", "1234567812345678\n", true, []string{"P:12345678", "F:12345678"}},
		{"long partial at the end", "1234567812", true, []string{"P:12345678", "P:12"}},
		{"max and an undecided carriage return at the end", "12345678\r", true, []string{"P:12345678", "P:\r"}},
	}
	for _, c := range cases {
		for _, step := range []int{0, 1, 3} {
			got := records(8, step, c.input, c.closed)
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Errorf("%s (pieces of %d): got %q, want %q", c.name, step, got, c.want)
			}
		}
	}
}

func TestLogLinerKeepsNoMoreThanALine(t *testing.T) {
	l := newLogLiner(maxLogLine)
	n := 0
	l.feed([]byte(strings.Repeat("y", 10*maxLogLine+5)), func(partial bool, text []byte) {
		if !partial || len(text) != maxLogLine {
			t.Fatalf("record of %d bytes (partial %v)", len(text), partial)
		}
		n++
	})
	if n != 10 || len(l.pending) != 5 {
		t.Fatalf("%d records, %d bytes pending", n, len(l.pending))
	}
}

func TestCRIRecord(t *testing.T) {
	ts := time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)
	cases := []struct {
		stream  string
		partial bool
		text    string
		want    string
	}{
		{"stdout", false, "hi", "2024-05-06T07:08:09.123456789Z stdout F hi\n"},
		{"stderr", true, "", "2024-05-06T07:08:09.123456789Z stderr P \n"},
	}
	for _, c := range cases {
		if got := string(criRecord(ts, c.stream, c.partial, []byte(c.text))); got != c.want {
			t.Errorf("got %q, want %q", got, c.want)
		}
	}
}

// Whatever the input and however it is split into reads, the records are the same, none is
// longer than max, only the last may be an unended P record, and the texts put back together
// (F records ending a line) give the input with each line's "\r\n" read as "\n".
func TestLogLinerInvariants(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	alphabet := []byte("ab\r\n")
	for round := 0; round < 2000; round++ {
		input := make([]byte, rng.Intn(60))
		for i := range input {
			input[i] = alphabet[rng.Intn(len(alphabet))]
		}
		max := 1 + rng.Intn(6)
		whole := records(max, 0, string(input), true)
		if pieces := records(max, 1+rng.Intn(7), string(input), true); fmt.Sprint(pieces) != fmt.Sprint(whole) {
			t.Fatalf("%q (max %d): %q at once, %q in pieces", input, max, whole, pieces)
		}
		var rebuilt strings.Builder
		for i, r := range whole {
			tag, text := r[:1], r[2:]
			if len(text) > max {
				t.Fatalf("%q (max %d): record %q over max", input, max, r)
			}
			rebuilt.WriteString(text)
			if tag == "F" {
				rebuilt.WriteString("\n")
			} else if i == len(whole)-1 && strings.HasSuffix(string(input), "\n") {
				t.Fatalf("%q (max %d): last record %q is partial though the input ends a line", input, max, r)
			}
		}
		if want := strings.ReplaceAll(string(input), "\r\n", "\n"); rebuilt.String() != want {
			t.Fatalf("%q (max %d): records %q rebuild %q", input, max, whole, rebuilt.String())
		}
	}
}
