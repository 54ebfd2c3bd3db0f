package main

import "time"

// Streamed processes, attach sessions and forwarded connections are leased to the host that
// opened them: all are released when it goes away (its channel closed), and each one no
// request touched for procLease is released by that registry's janitor.

// idleLister returns the release functions of a registry's entries idle for longer than idle
// (0: every entry), collected under the registry's own lock and called after it is let go.
type idleLister func(idle time.Duration) []func()

func releaseIdle(list idleLister, idle time.Duration) {
	for _, release := range list(idle) {
		release()
	}
}

// janitor releases, every 30 s, what no host request touched for procLease.
func janitor(list idleLister) {
	for {
		time.Sleep(30 * time.Second)
		releaseIdle(list, procLease)
	}
}

func idleFor(seen time.Time, idle time.Duration) bool {
	return idle == 0 || time.Since(seen) > idle
}

func idleProcs(idle time.Duration) []func() {
	procs.Lock()
	defer procs.Unlock()
	var out []func()
	for _, p := range procs.m {
		p.mu.Lock()
		if idleFor(p.seen, idle) {
			out = append(out, p.kill)
		}
		p.mu.Unlock()
	}
	return out
}

func idleAttaches(idle time.Duration) []func() {
	attaches.Lock()
	defer attaches.Unlock()
	var out []func()
	for _, s := range attaches.m {
		if idleFor(s.seen, idle) {
			out = append(out, s.release)
		}
	}
	return out
}

func idleForwards(idle time.Duration) []func() {
	fwds.Lock()
	defer fwds.Unlock()
	var out []func()
	for _, fc := range fwds.m {
		if idleFor(fc.seen, idle) {
			out = append(out, fc.close)
		}
	}
	return out
}

// releaseAllLeases: the host went away; nobody will read these processes, sessions or connections.
func releaseAllLeases() {
	releaseIdle(idleProcs, 0)
	releaseIdle(idleAttaches, 0)
	releaseIdle(idleForwards, 0)
}
