package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"testing"
	"time"
)

// A restored guest's greeter can be building a hello (slow under emulation) while a host's request
// acks the agent, personalize gives it a new instance and answers, and that host goes. The hello is
// then written before the answer, never after it with the instance of before: the next host to
// connect would take that for an agent that started over.
func TestAHelloNeverFollowsAnAnswerWithAnOlderInstance(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(r); out <- b }()
	p := &port{f: w, unacked: make(chan struct{}, 1)}

	was := currentInstance()
	setInstance("before")
	built, release := make(chan struct{}), make(chan struct{})
	helloBuilt = func() { close(built); <-release }
	defer func() { helloBuilt = nil; setInstance(was) }()

	greeted := make(chan struct{})
	go func() { p.sendHello(); close(greeted) }()
	<-built
	p.setAcked(true) // a host's personalize request arrives
	setInstance("after")
	answered := make(chan struct{})
	go func() {
		p.send(map[string]interface{}{"type": "response", "id": "1", "ok": true, "body": report()})
		close(answered)
	}()
	time.Sleep(50 * time.Millisecond) // the answer is written now, unless the hello holds the port
	p.setAcked(false)                 // that host went
	close(release)
	<-greeted
	<-answered
	w.Close()

	type msg struct {
		Type string `json:"type"`
		Body struct {
			Instance string `json:"instance"`
		} `json:"body"`
	}
	var got []msg
	for _, line := range bytes.Split(bytes.TrimSpace(<-out), []byte("\n")) {
		var m msg
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		got = append(got, m)
	}
	if len(got) != 2 || got[0].Type != "hello" || got[1].Type != "response" || got[1].Body.Instance != "after" {
		t.Fatalf("want the hello, then the answer with the new instance; got %+v", got)
	}
}

func setInstance(id string) {
	instanceMu.Lock()
	instance = id
	instanceMu.Unlock()
}
