package main

import "time"

// Stream sessions (streamed processes, attach sessions and forwarded connections, session.go) are
// leased to the host that opened them: all are released when it goes away (its channel closed),
// and each one no request touched for sessionLease is released by the janitor.

func init() { go janitor() }

// releaseIdle releases the sessions of every registry idle for longer than idle (0: every one),
// each listed under its registry's lock and released after it is let go.
func releaseIdle(idle time.Duration) {
	for _, r := range registries {
		for _, release := range r.idle(idle) {
			release()
		}
	}
}

// janitor releases, every 30 s, what no host request touched for sessionLease.
func janitor() {
	for {
		time.Sleep(30 * time.Second)
		releaseIdle(sessionLease)
	}
}

// releaseAllLeases: the host went away; nobody will read these processes, sessions or connections.
func releaseAllLeases() {
	releaseIdle(0)
}
