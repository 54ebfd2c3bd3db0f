package main

// Which path a call takes through the front (pure): the few calls the kubelet makes all the time
// for ordinary pods go straight to the downstream runtime, everything else to the shim, which
// routes it as it would without the front. The wire formats the decision reads: the gRPC
// message prefix, a request's top-level protobuf fields, and grpc-timeout.

import (
	"encoding/binary"
	"errors"
	"strconv"
	"time"
)

const (
	runtimeService = "/runtime.v1.RuntimeService/"
	imageService   = "/runtime.v1.ImageService/"
	internalPrefix = "/vmsandbox.internal."
	// the one method of the shim's internal service: the downstream's last unfiltered list
	sawListPath = "/vmsandbox.internal.Front/SawList"

	// headers between the front and the shim; a client's are dropped
	headerPrefix     = "vmsandbox-"
	headerOwner      = "vmsandbox-owner"      // reply: this exact id is the downstream's
	headerSide       = "vmsandbox-side"       // request: answer vmsandbox's own side of a list only
	headerDownstream = "vmsandbox-downstream" // request: the downstream just failed this call, why
	headerList       = "vmsandbox-list"       // SawList: which list the bytes are

	maxMessage = 16 << 20 // what the kubelet accepts from a runtime
)

// path is how the front serves a call.
type path int

const (
	viaShim      path = iota // relayed to the shim as it came
	byID                     // to the downstream when the id is one the shim said is the downstream's
	mergedList               // both sides at once, the replies concatenated
	cachedAnswer             // the shim's answer, kept (Version)
	refused                  // the shim's internal service: not for clients
)

// kind of id a byID method names in its field 1
type idKind int

const (
	sandboxID idKind = iota
	containerID
)

type method struct {
	path path
	kind idKind
	// for mergedList: the filter fields (inside field 1) that name an id; the shim routes those
	idFilterFields []uint64
	// for calls relayed to the shim: a success forgets the id (of this kind) of field 1
	forgets bool
}

// Methods not in the table go to the shim as they came. Among them the lists the shim merges
// itself: the stats lists and ListPodSandboxMetrics, whose answers change with every reading, so
// none can be kept for as long as the records' generation stands as mergedList answers are.
var methods = map[string]method{
	runtimeService + "Version":          {path: cachedAnswer},
	runtimeService + "ContainerStatus":  {path: byID, kind: containerID},
	runtimeService + "ContainerStats":   {path: byID, kind: containerID},
	runtimeService + "PodSandboxStatus": {path: byID, kind: sandboxID},
	runtimeService + "PodSandboxStats":  {path: byID, kind: sandboxID},
	// PodSandboxFilter: id = 1; ContainerFilter: id = 1, pod_sandbox_id = 3
	runtimeService + "ListPodSandbox":   {path: mergedList, idFilterFields: []uint64{1}},
	runtimeService + "ListContainers":   {path: mergedList, idFilterFields: []uint64{1, 3}},
	runtimeService + "RemoveContainer":  {path: viaShim, kind: containerID, forgets: true},
	runtimeService + "RemovePodSandbox": {path: viaShim, kind: sandboxID, forgets: true},
}

// readOnlyMethods change none of the shim's records (a list or status that finds a container
// exited records it, but a record's change moves the generation, which the shim tells the front)
var readOnlyMethods = map[string]bool{
	runtimeService + "Version": true, runtimeService + "Status": true,
	runtimeService + "PodSandboxStatus": true, runtimeService + "ContainerStatus": true,
	runtimeService + "ListPodSandbox": true, runtimeService + "ListContainers": true,
	runtimeService + "PodSandboxStats": true, runtimeService + "ContainerStats": true,
	runtimeService + "ListPodSandboxStats": true, runtimeService + "ListContainerStats": true,
	runtimeService + "RuntimeConfig": true, runtimeService + "ListMetricDescriptors": true,
	runtimeService + "ListPodSandboxMetrics": true,
	imageService + "ListImages":              true, imageService + "ImageStatus": true,
	imageService + "ImageFsInfo": true, "/grpc.health.v1.Health/Check": true,
}

func readOnly(p string) bool { return readOnlyMethods[p] }

func classify(p string) method {
	if m, ok := methods[p]; ok {
		return m
	}
	if len(p) >= len(internalPrefix) && p[:len(internalPrefix)] == internalPrefix {
		return method{path: refused}
	}
	return method{path: viaShim}
}

var errMalformed = errors.New("malformed protobuf")

// field is one top-level protobuf field of a message: its number and, for length-delimited
// fields, its bytes (nil for the other wire types).
type field struct {
	num   uint64
	bytes []byte
}

// fields walks a protobuf message's top-level fields; errMalformed for bytes that are not one.
func fields(msg []byte) ([]field, error) {
	var out []field
	for len(msg) > 0 {
		key, n := binary.Uvarint(msg)
		if n <= 0 {
			return nil, errMalformed
		}
		msg = msg[n:]
		f := field{num: key >> 3}
		if f.num == 0 {
			return nil, errMalformed
		}
		switch key & 7 {
		case 0: // varint
			_, n = binary.Uvarint(msg)
			if n <= 0 {
				return nil, errMalformed
			}
			msg = msg[n:]
		case 1: // 64-bit
			if len(msg) < 8 {
				return nil, errMalformed
			}
			msg = msg[8:]
		case 2:
			l, n := binary.Uvarint(msg)
			if n <= 0 || l > uint64(len(msg)-n) {
				return nil, errMalformed
			}
			f.bytes = msg[n : n+int(l)]
			msg = msg[n+int(l):]
		case 5: // 32-bit
			if len(msg) < 4 {
				return nil, errMalformed
			}
			msg = msg[4:]
		default: // groups are not in the CRI
			return nil, errMalformed
		}
		out = append(out, f)
	}
	return out, nil
}

// stringField is the value of a string field (the last one wins, as protobuf merges); ok false
// for a malformed message.
func stringField(msg []byte, num uint64) (string, bool) {
	fs, err := fields(msg)
	if err != nil {
		return "", false
	}
	v := ""
	for _, f := range fs {
		if f.num == num {
			if f.bytes == nil {
				return "", false
			}
			v = string(f.bytes)
		}
	}
	return v, true
}

// listFilter says of a list request whether its filter names an id (the shim routes those) and
// whether it has no filter at all (what the kubelet's relist asks: its reply is kept by the shim).
func listFilter(msg []byte, idFields []uint64) (namesID, unfiltered, ok bool) {
	fs, err := fields(msg)
	if err != nil {
		return false, false, false
	}
	unfiltered = true
	for _, f := range fs {
		if f.num != 1 {
			continue
		}
		if f.bytes == nil {
			return false, false, false
		}
		if len(f.bytes) > 0 {
			unfiltered = false
		}
		inner, err := fields(f.bytes)
		if err != nil {
			return false, false, false
		}
		for _, g := range inner {
			for _, want := range idFields {
				if g.num == want && len(g.bytes) > 0 {
					namesID = true
				}
			}
		}
	}
	return namesID, unfiltered, true
}

// grpcMessage is the one uncompressed message of a unary gRPC body; ok false for anything else.
func grpcMessage(body []byte) ([]byte, bool) {
	if len(body) < 5 || body[0] != 0 {
		return nil, false
	}
	n := binary.BigEndian.Uint32(body[1:5])
	if uint64(n) != uint64(len(body)-5) {
		return nil, false
	}
	return body[5:], true
}

// grpcBody frames the concatenation of parts as one uncompressed gRPC message.
func grpcBody(parts ...[]byte) []byte {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	out := make([]byte, 5, 5+n)
	binary.BigEndian.PutUint32(out[1:5], uint32(n))
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// parseTimeout reads a grpc-timeout value ("100m", "5S"); ok false for a malformed one.
func parseTimeout(v string) (time.Duration, bool) {
	if len(v) < 2 || len(v) > 9 {
		return 0, false
	}
	n, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil || n < 0 {
		return 0, false
	}
	unit := map[byte]time.Duration{
		'H': time.Hour, 'M': time.Minute, 'S': time.Second,
		'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond,
	}[v[len(v)-1]]
	if unit == 0 {
		return 0, false
	}
	if n > int64((1<<63-1)/unit) {
		return 1<<63 - 1, true
	}
	return time.Duration(n) * unit, true
}

// formatTimeout writes d as a grpc-timeout value (at most 8 digits, as the spec allows).
func formatTimeout(d time.Duration) string {
	if d < time.Microsecond {
		d = time.Microsecond
	}
	if us := d / time.Microsecond; us < 1e8 {
		return strconv.FormatInt(int64(us), 10) + "u"
	}
	if ms := d / time.Millisecond; ms < 1e8 {
		return strconv.FormatInt(int64(ms), 10) + "m"
	}
	s := d / time.Second
	if s >= 1e8 {
		s = 1e8 - 1
	}
	return strconv.FormatInt(int64(s), 10) + "S"
}
