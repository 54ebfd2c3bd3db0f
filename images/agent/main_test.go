package main

import (
	"bufio"
	"bytes"
	"io"
	"strings"
	"testing"
)

// The agent reads request lines up to maxLine bytes, past its 64 KiB buffer, and refuses a longer
// one without losing the line after it.
func TestReadLineBounds(t *testing.T) {
	line := func(n int) string { return strings.Repeat("x", n-1) + "\n" }
	input := line(10) + line(65537) + line(maxLine) + line(maxLine+1) + line(20) + "tail"
	r := bufio.NewReaderSize(strings.NewReader(input), 65536)
	for _, want := range []int{10, 65537, maxLine} {
		got, err := readLine(r)
		if err != nil || len(got) != want || !bytes.HasSuffix(got, []byte("\n")) {
			t.Fatalf("a line of %d bytes: got %d bytes, %v", want, len(got), err)
		}
	}
	if _, err := readLine(r); err != errLineTooLong {
		t.Fatalf("a line of %d bytes: %v, want errLineTooLong", maxLine+1, err)
	}
	if got, err := readLine(r); err != nil || len(got) != 20 {
		t.Fatalf("the line after the refused one: %d bytes, %v", len(got), err)
	}
	if got, err := readLine(r); err != io.EOF || string(got) != "tail" {
		t.Fatalf("an unended last line: %q, %v", got, err)
	}
}
