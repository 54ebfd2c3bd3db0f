package main

// The CRI log format as containerd writes it (its internal/cri/io logger): one record per line,
// "<RFC3339Nano> <stream> <F|P> <text>\n". A line ends at "\n", and a "\r" just before it (what a
// terminal writes for every newline) is dropped with it; a line longer than maxLogLine is cut into
// P records of maxLogLine bytes; output that ends without a newline is a last P record. A
// container with a terminal has one output stream, logged as stdout.

import "time"

// logLiner cuts one output stream into CRI records; pure (no IO): emit gets each record's tag
// (partial or not) and text, which is only valid during the call.
type logLiner struct {
	max     int
	pending []byte // text of the current line not yet emitted; its last byte may be an undecided "\r"
}

func newLogLiner(max int) *logLiner { return &logLiner{max: max} }

// feed takes the next bytes of the stream.
func (l *logLiner) feed(p []byte, emit func(partial bool, text []byte)) {
	for len(p) > 0 {
		nl := -1
		for i, b := range p {
			if b == '\n' {
				nl = i
				break
			}
		}
		chunk := p
		if nl >= 0 {
			chunk = p[:nl]
		}
		for _, b := range chunk {
			l.pending = append(l.pending, b)
			// a trailing "\r" is not yet text: a "\n" may follow and take it away
			undecided := 0
			if b == '\r' {
				undecided = 1
			}
			for len(l.pending)-undecided > l.max {
				emit(true, l.pending[:l.max])
				l.pending = append(l.pending[:0], l.pending[l.max:]...)
			}
		}
		if nl < 0 {
			return
		}
		text := l.pending
		if n := len(text); n > 0 && text[n-1] == '\r' {
			text = text[:n-1]
		}
		emit(false, text)
		l.pending = l.pending[:0]
		p = p[nl+1:]
	}
}

// end: the stream closed; what is left is a partial line.
func (l *logLiner) end(emit func(partial bool, text []byte)) {
	if len(l.pending) > l.max {
		emit(true, l.pending[:l.max])
		l.pending = l.pending[l.max:]
	}
	if len(l.pending) > 0 {
		emit(true, l.pending)
	}
	l.pending = nil
}

// criRecord is one record of the CRI log format.
func criRecord(ts time.Time, stream string, partial bool, text []byte) []byte {
	tag := "F"
	if partial {
		tag = "P"
	}
	out := make([]byte, 0, len(text)+len(stream)+40)
	out = ts.UTC().AppendFormat(out, time.RFC3339Nano)
	out = append(out, ' ')
	out = append(out, stream...)
	out = append(out, ' ')
	out = append(out, tag...)
	out = append(out, ' ')
	out = append(out, text...)
	return append(out, '\n')
}
