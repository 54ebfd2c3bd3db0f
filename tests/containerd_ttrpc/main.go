// Command containerd_ttrpc is containerd's side of shim mode's ttrpc, built from the modules
// containerd v2.4.2 builds with (containerd/api v1.12.0, containerd/ttrpc v1.2.9), for
// tests/shim/containerd/test_containerd_ttrpc.py:
//
//	containerd_ttrpc state SOCKET ID...
//	    calls containerd.task.v3.Task/State for each ID with the generated ttrpc client and
//	    prints one JSON line per call: the reply's fields, or the error as containerd reads it
//	    (errgrpc.ToNative, then errdefs' kinds); then one line for a Pids call, which the test's
//	    server does not serve.
//	containerd_ttrpc events SOCKET COUNT
//	    serves containerd.services.events.ttrpc.v1.Events on SOCKET, prints "listening", then one
//	    JSON line per forwarded envelope, its event decoded by typeurl as containerd decodes it,
//	    and exits after COUNT envelopes.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	_ "github.com/containerd/containerd/api/events" // registers the task events' types
	taskv3 "github.com/containerd/containerd/api/runtime/task/v3"
	eventsv1 "github.com/containerd/containerd/api/services/ttrpc/events/v1"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
)

func main() {
	if len(os.Args) < 3 {
		fail("usage: containerd_ttrpc state SOCKET ID... | events SOCKET COUNT")
	}
	var err error
	switch os.Args[1] {
	case "state":
		err = state(os.Args[2], os.Args[3:])
	case "events":
		var count int
		if len(os.Args) != 4 {
			fail("usage: containerd_ttrpc events SOCKET COUNT")
		}
		if count, err = strconv.Atoi(os.Args[3]); err == nil {
			err = events(os.Args[2], count)
		}
	default:
		fail("unknown command " + os.Args[1])
	}
	if err != nil {
		fail(err.Error())
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "containerd_ttrpc:", msg)
	os.Exit(2)
}

func emit(v any) {
	line, err := json.Marshal(v)
	if err != nil {
		fail(err.Error())
	}
	fmt.Println(string(line))
}

// kind is the errdefs kind containerd sees in err, as its CRI plugin tests it.
func kind(err error) string {
	switch {
	case errdefs.IsNotFound(err):
		return "not_found"
	case errdefs.IsInvalidArgument(err):
		return "invalid_argument"
	case errdefs.IsAlreadyExists(err):
		return "already_exists"
	case errdefs.IsFailedPrecondition(err):
		return "failed_precondition"
	case errdefs.IsNotImplemented(err):
		return "not_implemented"
	case errdefs.IsResourceExhausted(err):
		return "resource_exhausted"
	case errdefs.IsUnavailable(err):
		return "unavailable"
	case errdefs.IsInternal(err):
		return "internal"
	}
	return "unknown"
}

func state(socket string, ids []string) error {
	conn, err := net.DialTimeout("unix", socket, 10*time.Second)
	if err != nil {
		return err
	}
	client := ttrpc.NewClient(conn)
	defer client.Close()
	tasks := taskv3.NewTTRPCTaskClient(client)
	for _, id := range ids {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := tasks.State(ctx, &taskv3.StateRequest{ID: id})
		cancel()
		if err != nil {
			native := errgrpc.ToNative(err)
			emit(map[string]any{"id": id, "error": native.Error(), "kind": kind(native)})
			continue
		}
		emit(map[string]any{
			"id": resp.ID, "bundle": resp.Bundle, "pid": resp.Pid, "status": resp.Status.String(),
			"exit_status": resp.ExitStatus, "stdout": resp.Stdout, "terminal": resp.Terminal,
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := tasks.Pids(ctx, &taskv3.PidsRequest{ID: "any"}); err != nil {
		native := errgrpc.ToNative(err)
		emit(map[string]any{"method": "Pids", "error": native.Error(), "kind": kind(native)})
	} else {
		emit(map[string]any{"method": "Pids"})
	}
	return nil
}

type forwarded struct {
	got chan *eventsv1.ForwardRequest
}

func (f *forwarded) Forward(_ context.Context, req *eventsv1.ForwardRequest) (*emptypb.Empty, error) {
	f.got <- req
	return &emptypb.Empty{}, nil
}

func events(socket string, count int) error {
	server, err := ttrpc.NewServer()
	if err != nil {
		return err
	}
	f := &forwarded{got: make(chan *eventsv1.ForwardRequest, count)}
	eventsv1.RegisterTTRPCEventsService(server, f)
	l, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	go func() { _ = server.Serve(context.Background(), l) }()
	defer server.Close()
	fmt.Println("listening")
	for range count {
		req := <-f.got
		env := req.GetEnvelope()
		if env == nil {
			return errors.New("a ForwardRequest without an envelope")
		}
		out := map[string]any{
			"namespace": env.GetNamespace(), "topic": env.GetTopic(), "type_url": env.GetEvent().GetTypeUrl(),
			"timestamp_set": env.GetTimestamp().IsValid() && env.GetTimestamp().AsTime().Unix() > 0,
		}
		decoded, err := typeurl.UnmarshalAny(env.GetEvent())
		if err != nil {
			out["error"] = err.Error()
		} else if m, ok := decoded.(proto.Message); ok {
			out["go_type"] = fmt.Sprintf("%T", decoded)
			body, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
			if err != nil {
				return err
			}
			out["event"] = json.RawMessage(body)
		}
		emit(out)
	}
	return nil
}
