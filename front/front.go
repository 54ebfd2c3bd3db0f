package main

// The paths of route.go, served: a call relayed to the shim frame by frame; a by-id call sent
// straight to the downstream when the shim has said the id is the downstream's; a list asked of
// both sides at once and the replies concatenated (protobuf appends repeated fields of
// concatenated messages, and each side has applied the filter); Version answered as the shim
// last answered it. The shim's side of a list is kept when the shim says it holds for its
// records' generation, and used again while that generation stands and no call that may change
// the records has been answered since (its reply passes here before the caller sees it, so a
// list the caller asks after a change it made never gets the list from before it). Whenever the downstream cannot answer a call sent straight to it (it cannot
// be reached, resets the call, or is slower than downstream_timeout_s), the call goes to the
// shim instead, marked so that the shim does not ask the downstream again but answers as it does
// for an unavailable downstream (UNAVAILABLE naming it, or a list's last listing).

import (
	"bytes"
	"errors"
	"fmt"
	"log"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

const (
	maxLearned  = 1 << 17 // ids held per kind; the set starts again beyond it
	maxVersions = 16      // Version replies kept (one per distinct request)
	maxKept     = 64      // the shim's list answers kept (one per distinct request)
)

// kept is the shim's side of a list as it answered it.
type kept struct {
	body       []byte // the gRPC body
	generation uint64 // the shim's records' generation it holds for
	epoch      uint64 // the front's epoch when it was asked
}

type front struct {
	shim       *upstream
	downstream *upstream
	lists      *localLists   // nil: the lists' own side goes to the shim over gRPC
	timeout    time.Duration // downstream_timeout_s
	maxConns   int           // client connections at once
	budget     *budget       // bytes held for all clients at once (limits.go)
	// per client connection (limits.go): replies waiting for its window at once, how long one may
	// wait, how long it may stay idle, and how long its preface and SETTINGS may take
	connPending      int
	windowTimeout    time.Duration
	idleTimeout      time.Duration
	handshakeTimeout time.Duration
	conns            atomic.Int64 // client connections open
	lastLog          atomic.Int64 // when logf last wrote (unix nanoseconds)

	mu       sync.Mutex
	learned  [2]map[string]struct{} // by idKind: ids the shim said are the downstream's
	versions map[string][]byte      // Version request -> the shim's reply message
	saw      [2]sawWork             // SawList, per list

	generation uint64 // the shim's newest records' generation (0: unknown, nothing kept holds)
	epoch      uint64 // one more at each reply of a call that may have changed the shim's records
	kept       map[string]kept
}

func newFront(shim, downstream *upstream, timeout time.Duration) *front {
	return &front{
		shim: shim, downstream: downstream, timeout: timeout,
		maxConns: defaultMaxConns, budget: newBudget(defaultMaxBuffered),
		connPending: maxConnPending, windowTimeout: defaultWindowTimeout,
		idleTimeout: defaultIdleTimeout, handshakeTimeout: defaultHandshakeTimeout,
		learned:  [2]map[string]struct{}{{}, {}},
		versions: map[string][]byte{},
		kept:     map[string]kept{},
	}
}

// logf logs a client's misbehaviour, one line a second at most: clients cannot flood the log.
func (f *front) logf(format string, args ...any) {
	now := time.Now().UnixNano()
	last := f.lastLog.Load()
	if now-last < int64(time.Second) || !f.lastLog.CompareAndSwap(last, now) {
		return
	}
	log.Printf(format, args...)
}

// setGeneration is the shim's newest generation, from the list channel.
func (f *front) setGeneration(g uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.generation = g
	if g == 0 {
		f.kept = map[string]kept{}
	}
}

// changed is a reply of a call that may have changed the shim's records, on its way to its caller.
func (f *front) changed() {
	f.mu.Lock()
	f.epoch++
	f.mu.Unlock()
}

func (f *front) currentEpoch() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.epoch
}

// keptList is the shim's side of a list if what was kept of it still holds.
func (f *front) keptList(key string) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k, ok := f.kept[key]
	if !ok || f.generation == 0 || k.generation != f.generation || k.epoch != f.epoch {
		return nil, false
	}
	return k.body, true
}

func (f *front) keep(key string, k kept) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.kept) >= maxKept {
		f.kept = map[string]kept{}
	}
	f.kept[key] = k
}

func (f *front) isDownstreams(k idKind, id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.learned[k][id]
	return ok
}

func (f *front) learn(k idKind, id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.learned[k]) >= maxLearned {
		f.learned[k] = map[string]struct{}{}
	}
	f.learned[k][id] = struct{}{}
}

func (f *front) unlearn(k idKind, id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.learned[k], id)
}

// serve sends a complete request on its way.
func (f *front) serve(s *stream) {
	m := classify(s.path)
	msg, framed := grpcMessage(s.body)
	switch {
	case m.path == refused:
		s.answer(codeUnimplemented, "unknown service")
	case !framed:
		f.viaShim(s, m, "")
	case m.path == byID:
		if id, ok := stringField(msg, 1); ok && id != "" && f.isDownstreams(m.kind, id) {
			f.direct(s)
			return
		}
		f.viaShim(s, m, "")
	case m.path == mergedList:
		namesID, unfiltered, ok := listFilter(msg, m.idFilterFields)
		if !ok || namesID {
			f.viaShim(s, m, "")
			return
		}
		f.merged(s, unfiltered)
	case m.path == cachedAnswer:
		f.mu.Lock()
		reply, ok := f.versions[string(msg)]
		f.mu.Unlock()
		if ok {
			s.reply(okHeaders(), grpcBody(reply), okTrailers())
			return
		}
		f.collect(f.shim, s, s.forwardHeaders(), func(r result) {
			if r.ok() {
				if m, ok := grpcMessage(r.body); ok {
					f.mu.Lock()
					if len(f.versions) < maxVersions {
						f.versions[string(msg)] = m
					}
					f.mu.Unlock()
				}
			}
			f.answer(s, r)
		})
	default:
		f.viaShim(s, m, "")
	}
}

// viaShim relays the call to the shim; downstreamDown, when set, is why the downstream just
// failed it (the shim then answers without asking the downstream).
func (f *front) viaShim(s *stream, m method, downstreamDown string) {
	var extra []hpack.HeaderField
	if downstreamDown != "" {
		extra = append(extra, hpack.HeaderField{Name: headerDownstream, Value: percentEncode(bound(downstreamDown, 512))})
	}
	r := &relay{s: s, f: f, readOnly: readOnly(s.path)}
	if m.path == byID || m.forgets {
		if msg, ok := grpcMessage(s.body); ok {
			if id, ok := stringField(msg, 1); ok && id != "" {
				r.id, r.kind, r.forgets = id, m.kind, m.forgets
			}
		}
	}
	up := f.shim.start(s.forwardHeaders(extra...), s.body, r)
	if !s.wait(up) {
		up.cancel()
	}
}

// relay passes the shim's reply to the client as it comes, minus the shim's own headers (which it
// learns from), and forgets a removed id.
type relay struct {
	s        *stream
	f        *front
	id       string
	kind     idKind
	forgets  bool
	readOnly bool // the call changes none of the shim's records
	sent     bool // headers have gone to the client
}

func (r *relay) headers(fields []hpack.HeaderField, end bool) {
	out := make([]hpack.HeaderField, 0, len(fields))
	for _, h := range fields {
		if h.Name == headerOwner {
			if h.Value == "downstream" && r.id != "" && !r.forgets {
				r.f.learn(r.kind, r.id)
			}
			continue
		}
		out = append(out, h)
	}
	if end && r.forgets && r.id != "" && header(fields, "grpc-status") == "0" {
		r.f.unlearn(r.kind, r.id)
	}
	r.sent = true
	r.forward(item{headers: out, end: end})
}

func (r *relay) data(p []byte, end bool) { r.forward(item{data: append([]byte(nil), p...), end: end}) }

func (r *relay) forward(it item) {
	if it.end {
		if !r.readOnly {
			r.f.changed() // before the caller can ask again
		}
		if !r.s.finishing() {
			return
		}
		r.s.c.send(r.s.id, it)
		r.s.done()
		return
	}
	if !r.s.c.send(r.s.id, it) {
		r.s.abandon()
	}
}

func (r *relay) failed(err error) {
	if !r.readOnly {
		r.f.changed()
	}
	if r.sent {
		if r.s.finishing() {
			r.s.c.reset(r.s.id, http2.ErrCodeInternal) // the reply was cut off
			r.s.done()
		}
		return
	}
	if tooLarge(r.s, err) {
		return
	}
	r.f.shimUnavailable(r.s, err)
}

// errTooLarge: an upstream's reply is larger than the front passes on (a header list past
// maxHeaderList): that call fails RESOURCE_EXHAUSTED, as gRPC fails a reply past its limits.
type errTooLarge struct{ why string }

func (e errTooLarge) Error() string { return e.why }

// tooLarge answers the stream RESOURCE_EXHAUSTED if err is an errTooLarge.
func tooLarge(s *stream, err error) bool {
	var e errTooLarge
	if !errors.As(err, &e) {
		return false
	}
	s.answer(codeResourceExhausted, e.why)
	return true
}

// result is a whole reply, or why there is none.
type result struct {
	hdrs     []hpack.HeaderField
	body     []byte
	trailers []hpack.HeaderField
	err      error // the transport failed, or the front gave up waiting
}

// status is the reply's grpc-status (-1: none).
func (r result) status() int {
	v := header(r.trailers, "grpc-status")
	if v == "" {
		v = header(r.hdrs, "grpc-status") // trailers-only
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return -1
	}
	return n
}

func (r result) ok() bool { return r.err == nil && r.status() == codeOK }

// collector gathers a reply whole (bounded, its bytes counted in the front's budget while it
// holds them) and hands it on once.
type collector struct {
	b    *budget
	mu   sync.Mutex
	r    result
	held int   // bytes taken from b
	over error // the reply is not kept whole: why
	fin  bool  // handed on: what comes after is dropped
	done func(result)
	once sync.Once
}

func (c *collector) headers(fields []hpack.HeaderField, end bool) {
	c.mu.Lock()
	if c.r.hdrs == nil {
		c.r.hdrs = fields
	} else {
		c.r.trailers = fields
	}
	c.mu.Unlock()
	if end {
		c.finish(nil)
	}
}

func (c *collector) data(p []byte, end bool) {
	c.mu.Lock()
	switch {
	case c.over != nil || c.fin:
	case len(c.r.body)+len(p) > maxMessage+5:
		c.over = fmt.Errorf("reply larger than %d bytes", maxMessage)
	case !c.b.take(len(p)):
		c.over = errors.New("the front holds as many bytes as it takes")
	default:
		c.r.body = append(c.r.body, p...)
		c.held += len(p)
	}
	c.mu.Unlock()
	if end {
		c.finish(nil)
	}
}

func (c *collector) failed(err error) { c.finish(err) }

// release drops what was collected of a call given up (its reply is never handed on).
func (c *collector) release() {
	c.mu.Lock()
	held := c.held
	c.fin, c.held, c.r.body = true, 0, nil
	c.mu.Unlock()
	c.b.give(held)
}

func (c *collector) finish(err error) {
	c.once.Do(func() {
		c.mu.Lock()
		r := c.r
		if err != nil {
			r.err = err
		} else if c.over != nil {
			r.err = c.over
		}
		c.fin = true
		held := c.held
		c.held = 0 // a cancel racing this finish gives nothing back twice
		c.mu.Unlock()
		c.done(r) // the body is queued for the client (and counted there) or dropped
		c.b.give(held)
	})
}

// collect sends the call to up and gives its whole reply to done (from the reply's read loop).
// The client's cancel cancels it; it is given up after the caller's deadline, and for the
// downstream after downstream_timeout_s as well.
func (f *front) collect(up *upstream, s *stream, hdrs []hpack.HeaderField, done func(result)) {
	var (
		tmu   sync.Mutex
		timer *time.Timer
		over  bool
	)
	c := &collector{b: f.budget, done: func(r result) {
		tmu.Lock()
		over = true
		if timer != nil {
			timer.Stop()
		}
		tmu.Unlock()
		done(r)
	}}
	call := up.start(hdrs, s.body, c)
	if !s.wait(call) {
		call.cancel()
		return
	}
	wait := time.Duration(-1)
	if up == f.downstream {
		wait = f.timeout
	}
	if d, ok := s.deadline(); ok && (wait < 0 || d < wait) {
		wait = d
	}
	if wait < 0 {
		return
	}
	tmu.Lock()
	defer tmu.Unlock()
	if !over {
		timer = time.AfterFunc(wait, func() {
			call.cancel()
			c.finish(errTimedOut{wait})
		})
	}
}

type errTimedOut struct{ after time.Duration }

func (e errTimedOut) Error() string {
	return fmt.Sprintf("did not answer within %.1f s", e.after.Seconds())
}

// answer passes a collected reply to the client; a transport failure of the shim is UNAVAILABLE.
func (f *front) answer(s *stream, r result) {
	if r.err != nil {
		if _, timedOut := r.err.(errTimedOut); timedOut {
			if d, ok := s.deadline(); ok && d <= 0 {
				s.answer(codeDeadlineExceeded, "deadline exceeded")
				return
			}
		}
		if tooLarge(s, r.err) {
			return
		}
		f.shimUnavailable(s, r.err)
		return
	}
	s.reply(r.hdrs, r.body, r.trailers)
}

// shimUnavailable answers a call the shim could not be asked, or did not answer.
func (f *front) shimUnavailable(s *stream, err error) {
	s.answer(codeUnavailable, fmt.Sprintf("vmsandbox shim at %s: %v", f.shim.addr, err))
}

// downstreamFailed says why a call sent straight to the downstream did not get its answer
// ("": it did, whatever its status).
func (f *front) downstreamFailed(r result) string {
	if r.err == nil && r.status() >= 0 {
		return ""
	}
	why := "no status in its reply"
	if r.err != nil {
		why = r.err.Error()
	}
	return fmt.Sprintf("downstream CRI runtime %s: %s", f.downstream.name, why)
}

// direct sends a by-id call straight to the downstream; it goes to the shim if that fails.
func (f *front) direct(s *stream) {
	f.collect(f.downstream, s, s.forwardHeaders(), func(r result) {
		if why := f.downstreamFailed(r); why != "" {
			f.fallBack(s, why)
			return
		}
		s.reply(r.hdrs, r.body, r.trailers)
	})
}

// fallBack sends the call to the shim after the downstream failed it, unless the caller's own
// deadline has passed meanwhile.
func (f *front) fallBack(s *stream, why string) {
	if d, ok := s.deadline(); ok && d <= 0 {
		s.answer(codeDeadlineExceeded, "deadline exceeded: "+why)
		return
	}
	if s.settled() {
		f.viaShim(s, classify(s.path), why)
	}
}

// merged asks the downstream and the shim (its own side only) at once and concatenates.
func (f *front) merged(s *stream, unfiltered bool) {
	var (
		mu          sync.Mutex
		theirs, own *result
	)
	both := func() {
		if theirs == nil || own == nil {
			return
		}
		if why := f.downstreamFailed(*theirs); why != "" {
			f.fallBack(s, why)
			return
		}
		if !own.ok() {
			f.answer(s, *own)
			return
		}
		if !theirs.ok() {
			s.reply(theirs.hdrs, theirs.body, theirs.trailers)
			return
		}
		a, okA := grpcMessage(theirs.body)
		b, okB := grpcMessage(own.body)
		if !okA || !okB || len(a)+len(b) > maxMessage {
			f.viaShim(s, classify(s.path), "")
			return
		}
		s.reply(withoutLength(theirs.hdrs), grpcBody(a, b), theirs.trailers)
		if unfiltered {
			f.sawList(s.path, theirs.body)
		}
	}
	mine := func(r result) {
		mu.Lock()
		defer mu.Unlock()
		own = &r
		both()
	}
	overGRPC := func() { // vmsandbox's side without the list channel
		f.collect(f.shim, s, s.forwardHeaders(hpack.HeaderField{Name: headerSide, Value: "vmsandbox"}), mine)
	}
	msg, _ := grpcMessage(s.body)
	key := s.path + "\x00" + string(msg)
	if body, ok := f.keptList(key); ok {
		own = &result{hdrs: okHeaders(), body: body, trailers: okTrailers()}
	} else {
		epoch := f.currentEpoch()
		asked := f.lists.ask(s.path, msg, func(l listed) {
			if l.err == errListsDown { // the channel closed under this call: the slower way
				overGRPC()
				return
			}
			if l.generation != 0 && l.ok() {
				f.keep(key, kept{body: l.body, generation: l.generation, epoch: epoch})
			}
			mine(l.result)
		})
		if !asked {
			overGRPC()
		}
	}
	f.collect(f.downstream, s, s.forwardHeaders(), func(r result) {
		mu.Lock()
		defer mu.Unlock()
		theirs = &r
		both()
	})
}

var sawListKind = map[string]int{runtimeService + "ListPodSandbox": 0, runtimeService + "ListContainers": 1}

// sawList gives the shim the downstream's unfiltered list (it answers for the downstream's side
// with it while the downstream cannot), in the background: only a list that differs from the one
// it has, one call at a time per list, the newest after the one under way.
func (f *front) sawList(path string, body []byte) {
	k, ok := sawListKind[path]
	if !ok {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	w := &f.saw[k]
	if bytes.Equal(body, w.sent) {
		return
	}
	if w.busy {
		w.next = append([]byte(nil), body...)
		return
	}
	w.busy = true
	f.sendSawLocked(path, k, append([]byte(nil), body...))
}

// sawWork is what the shim has of one of the downstream's lists, and what it is about to get.
type sawWork struct {
	sent []byte // the last list the shim took
	busy bool   // a SawList under way
	next []byte // the newest list seen meanwhile
}

func (f *front) sendSawLocked(path string, k int, body []byte) {
	hdrs := []hpack.HeaderField{
		{Name: ":method", Value: "POST"},
		{Name: ":scheme", Value: "http"},
		{Name: ":path", Value: sawListPath},
		{Name: ":authority", Value: "vmsandbox"},
		{Name: "content-type", Value: "application/grpc"},
		{Name: "te", Value: "trailers"},
		{Name: headerList, Value: path[len(runtimeService):]},
		{Name: "grpc-timeout", Value: "5S"},
	}
	c := &collector{b: f.budget, done: func(r result) {
		if !r.ok() {
			log.Printf("SawList: %v %s", r.err, header(r.trailers, "grpc-message"))
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		w := &f.saw[k]
		if r.ok() {
			w.sent = body
		}
		next := w.next
		w.next = nil
		if next == nil {
			w.busy = false
			return
		}
		f.sendSawLocked(path, k, next)
	}}
	go f.shim.start(hdrs, body, c) // never under f.mu: its reply may come at once and take it
}

// withoutLength is a reply's headers for a body of another length than theirs said.
func withoutLength(hdrs []hpack.HeaderField) []hpack.HeaderField {
	out := make([]hpack.HeaderField, 0, len(hdrs))
	for _, h := range hdrs {
		if h.Name != "content-length" {
			out = append(out, h)
		}
	}
	return out
}

func okHeaders() []hpack.HeaderField {
	return []hpack.HeaderField{{Name: ":status", Value: "200"}, {Name: "content-type", Value: "application/grpc"}}
}

func okTrailers() []hpack.HeaderField {
	return []hpack.HeaderField{{Name: "grpc-status", Value: "0"}}
}
