package main

import (
	"encoding/base64"
	"strings"
	"testing"
	"time"
)

func decoded(t *testing.T, c logChunk) string {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(c.Data)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestWriterBlocksUntilTheHostAcknowledges(t *testing.T) {
	b := newLogBuffer(1)
	line := []byte(strings.Repeat("x", 1023) + "\n")
	wrote := make(chan int, 2*logHold/len(line))
	go func() {
		for i := 0; i < 2*logHold/len(line); i++ {
			b.write(line)
			wrote <- i
		}
	}()
	time.Sleep(200 * time.Millisecond)
	if n := len(wrote); n != logHold/len(line) {
		t.Fatalf("%d lines written before any acknowledgement, want %d", n, logHold/len(line))
	}
	c, err := b.read(0, 4096, 0)
	if err != nil || c.Offset != 0 || len(decoded(t, c)) != 4096 {
		t.Fatalf("read: %v %+v", err, c.Offset)
	}
	// asking from 4096 acknowledges four lines: four more get in
	if _, err := b.read(4096, 1, 0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if n := len(wrote); n != logHold/len(line)+4 {
		t.Fatalf("%d lines after acknowledging 4", n)
	}
}

func TestReadEndsAtALineAndWaits(t *testing.T) {
	b := newLogBuffer(1)
	b.write([]byte("aaaa\n"))
	b.write([]byte("bbbb\n"))
	c, _ := b.read(0, 7, 0)
	if decoded(t, c) != "aaaa\n" || c.EOF {
		t.Fatalf("got %q eof %v", decoded(t, c), c.EOF)
	}
	if _, err := b.read(100, 7, 0); err == nil {
		t.Fatal("an offset past the end must be refused")
	}
	start := time.Now()
	go func() { time.Sleep(100 * time.Millisecond); b.writerDone() }()
	c, _ = b.read(10, 7, 5*time.Second)
	if !c.EOF || decoded(t, c) != "" || time.Since(start) > 2*time.Second {
		t.Fatalf("eof %v after %v", c.EOF, time.Since(start))
	}
	b.close()
	if _, err := b.read(10, 7, 0); err == nil {
		t.Fatal("a deleted container's log must be refused")
	}
}
