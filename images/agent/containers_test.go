package main

import (
	"encoding/json"
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
