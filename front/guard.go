package main

// A bound on header blocks, ahead of the framer: the bytes a peer sends pass through blockGuard,
// which reads the frame headers as they go by and ends the connection when one header block
// (HEADERS or PUSH_PROMISE and its CONTINUATION frames) runs past maxBlockFrames frames or
// maxBlockBytes bytes. The framer bounds what a block decodes to, but not how many frames of no
// bytes it may take (CVE-2023-45288).

import (
	"io"

	"golang.org/x/net/http2"
)

const (
	maxBlockFrames = 16            // frames of one header block, the first included
	maxBlockBytes  = maxHeaderList // encoded bytes of one header block
)

var errHeaderFlood = connErr{http2.ErrCodeProtocol, "a header block of too many frames or bytes"}

type blockGuard struct {
	r      io.Reader
	hdr    [9]byte
	hn     int    // bytes seen of the current frame's header
	left   uint32 // payload bytes of the current frame still to pass
	frames int    // of the header block under way (0: none)
	bytes  uint32
	err    error
}

func (g *blockGuard) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.r.Read(p)
	for i := 0; i < n; {
		if g.left > 0 {
			k := uint32(n - i)
			if k > g.left {
				k = g.left
			}
			g.left -= k
			i += int(k)
			continue
		}
		g.hdr[g.hn] = p[i]
		g.hn++
		i++
		if g.hn < len(g.hdr) {
			continue
		}
		g.hn = 0
		g.left = uint32(g.hdr[0])<<16 | uint32(g.hdr[1])<<8 | uint32(g.hdr[2])
		if e := g.frame(http2.FrameType(g.hdr[3]), http2.Flags(g.hdr[4]), g.left); e != nil {
			g.err = e
			return i - 1, e // the offending frame's header never reaches the framer whole
		}
	}
	return n, err
}

func (g *blockGuard) frame(t http2.FrameType, flags http2.Flags, length uint32) error {
	switch t {
	case http2.FrameHeaders, http2.FramePushPromise:
		g.frames, g.bytes = 0, 0
		if !flags.Has(http2.FlagHeadersEndHeaders) {
			g.frames, g.bytes = 1, length
		}
	case http2.FrameContinuation:
		if g.frames == 0 {
			return nil // out of place: the framer says so
		}
		g.frames++
		g.bytes += length
		if g.frames > maxBlockFrames || g.bytes > maxBlockBytes {
			return errHeaderFlood
		}
		if flags.Has(http2.FlagContinuationEndHeaders) {
			g.frames, g.bytes = 0, 0
		}
	}
	return nil
}
