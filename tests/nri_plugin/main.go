// Command vmsandbox-nri-testplugin is an NRI plugin for vmsandbox's tests, built on
// containerd/nri's stub. Its behaviour comes from its configuration, a list of
// whitespace-separated key=value words, given by -config or, for a plugin the
// runtime starts, by the runtime's Configure request:
//
//	env=NAME=VALUE        add an environment variable to every created container
//	annotation=KEY=VALUE  add an annotation to every created container
//	memory=BYTES          set every created container's memory limit
//	cpu-quota=MICROS      set every created container's CPU quota (period 100000)
//	update-memory=BYTES   answer every UpdateContainer by setting that container's memory limit
//	rlimit=TYPE:SOFT:HARD add an rlimit to every created container
//	hang=EVENT            never answer EVENT (RunPodSandbox, CreateContainer, ...)
//	fail=EVENT            answer EVENT with an error
//	reject=REASON         reject every container's adjustments when asked to validate them
//	events=FILE           append one line per event to FILE: "<event> <pod> <container>"
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

type rlimit struct {
	typ        string
	soft, hard uint64
}

type plugin struct {
	stub        stub.Stub
	mu          sync.Mutex
	env         [][2]string
	annotations [][2]string
	memory      int64
	cpuQuota    int64
	updateMem   int64
	rlimits     []rlimit
	hang        map[string]bool
	fail        map[string]bool
	eventsFile  string
	reject      string
}

func (p *plugin) parse(config string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hang = map[string]bool{}
	p.fail = map[string]bool{}
	for _, word := range strings.Fields(config) {
		key, value, ok := strings.Cut(word, "=")
		if !ok {
			return fmt.Errorf("configuration word %q is not key=value", word)
		}
		switch key {
		case "env", "annotation":
			k, v, ok := strings.Cut(value, "=")
			if !ok {
				return fmt.Errorf("%s %q is not NAME=VALUE", key, value)
			}
			if key == "env" {
				p.env = append(p.env, [2]string{k, v})
			} else {
				p.annotations = append(p.annotations, [2]string{k, v})
			}
		case "memory", "cpu-quota", "update-memory":
			n, err := strconv.ParseInt(value, 10, 64)
			if err != nil {
				return fmt.Errorf("%s %q: %w", key, value, err)
			}
			switch key {
			case "memory":
				p.memory = n
			case "cpu-quota":
				p.cpuQuota = n
			default:
				p.updateMem = n
			}
		case "rlimit":
			parts := strings.Split(value, ":")
			if len(parts) != 3 {
				return fmt.Errorf("rlimit %q is not TYPE:SOFT:HARD", value)
			}
			soft, err1 := strconv.ParseUint(parts[1], 10, 64)
			hard, err2 := strconv.ParseUint(parts[2], 10, 64)
			if err := errors.Join(err1, err2); err != nil {
				return fmt.Errorf("rlimit %q: %w", value, err)
			}
			p.rlimits = append(p.rlimits, rlimit{parts[0], soft, hard})
		case "hang":
			p.hang[value] = true
		case "fail":
			p.fail[value] = true
		case "events":
			p.eventsFile = value
		case "reject":
			p.reject = value
		default:
			return fmt.Errorf("unknown configuration key %q", key)
		}
	}
	return nil
}

// event records an event and hangs or fails it when configured to.
func (p *plugin) event(ctx context.Context, name string, pod *api.PodSandbox, ctr *api.Container) error {
	p.mu.Lock()
	file, hang, fail := p.eventsFile, p.hang[name], p.fail[name]
	p.mu.Unlock()
	if file != "" {
		podName, ctrName := "-", "-"
		if pod != nil {
			podName = pod.GetName()
		}
		if ctr != nil {
			ctrName = ctr.GetName()
		}
		line := fmt.Sprintf("%s %s %s\n", name, podName, ctrName)
		if f, err := os.OpenFile(file, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
			_, _ = f.WriteString(line)
			_ = f.Close()
		}
	}
	if hang {
		<-ctx.Done()
		select {} // never answer, even after the caller gave up
	}
	if fail {
		return fmt.Errorf("test plugin refuses %s of %s", name, pod.GetName())
	}
	return nil
}

func (p *plugin) Configure(_ context.Context, config, runtime, version string) (api.EventMask, error) {
	if config != "" {
		if err := p.parse(config); err != nil {
			return 0, err
		}
	}
	return 0, nil // all events
}

func (p *plugin) Synchronize(ctx context.Context, pods []*api.PodSandbox, ctrs []*api.Container) ([]*api.ContainerUpdate, error) {
	return nil, p.event(ctx, "Synchronize", nil, nil)
}

func (p *plugin) RunPodSandbox(ctx context.Context, pod *api.PodSandbox) error {
	return p.event(ctx, "RunPodSandbox", pod, nil)
}

func (p *plugin) StopPodSandbox(ctx context.Context, pod *api.PodSandbox) error {
	return p.event(ctx, "StopPodSandbox", pod, nil)
}

func (p *plugin) RemovePodSandbox(ctx context.Context, pod *api.PodSandbox) error {
	return p.event(ctx, "RemovePodSandbox", pod, nil)
}

func (p *plugin) CreateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	if err := p.event(ctx, "CreateContainer", pod, ctr); err != nil {
		return nil, nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	adjust := &api.ContainerAdjustment{}
	for _, kv := range p.env {
		adjust.AddEnv(kv[0], kv[1])
	}
	for _, kv := range p.annotations {
		adjust.AddAnnotation(kv[0], kv[1])
	}
	if p.memory != 0 {
		adjust.SetLinuxMemoryLimit(p.memory)
	}
	if p.cpuQuota != 0 {
		adjust.SetLinuxCPUQuota(p.cpuQuota)
		adjust.SetLinuxCPUPeriod(100000)
	}
	for _, r := range p.rlimits {
		adjust.AddRlimit(r.typ, r.hard, r.soft)
	}
	return adjust, nil, nil
}

func (p *plugin) PostCreateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	return p.event(ctx, "PostCreateContainer", pod, ctr)
}

func (p *plugin) StartContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	return p.event(ctx, "StartContainer", pod, ctr)
}

func (p *plugin) PostStartContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	return p.event(ctx, "PostStartContainer", pod, ctr)
}

func (p *plugin) UpdateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container, res *api.LinuxResources) ([]*api.ContainerUpdate, error) {
	if err := p.event(ctx, "UpdateContainer", pod, ctr); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.updateMem == 0 {
		return nil, nil
	}
	u := &api.ContainerUpdate{ContainerId: ctr.GetId()}
	u.SetLinuxMemoryLimit(p.updateMem)
	return []*api.ContainerUpdate{u}, nil
}

func (p *plugin) PostUpdateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	return p.event(ctx, "PostUpdateContainer", pod, ctr)
}

func (p *plugin) StopContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) ([]*api.ContainerUpdate, error) {
	return nil, p.event(ctx, "StopContainer", pod, ctr)
}

func (p *plugin) RemoveContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	return p.event(ctx, "RemoveContainer", pod, ctr)
}

func (p *plugin) ValidateContainerAdjustment(ctx context.Context, req *api.ValidateContainerAdjustmentRequest) error {
	if err := p.event(ctx, "ValidateContainerAdjustment", req.GetPod(), req.GetContainer()); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.reject != "" {
		return errors.New(p.reject)
	}
	return nil
}

func main() {
	var (
		name   = flag.String("name", "", "plugin name (when not started by the runtime)")
		idx    = flag.String("idx", "", "plugin index (when not started by the runtime)")
		socket = flag.String("socket", "", "the runtime's NRI socket (when not started by the runtime)")
		config = flag.String("config", "", "configuration words, as the runtime would send them")
	)
	flag.Parse()

	p := &plugin{}
	if err := p.parse(*config); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	opts := []stub.Option{stub.WithOnClose(func() { os.Exit(0) })}
	if *name != "" {
		opts = append(opts, stub.WithPluginName(*name))
	}
	if *idx != "" {
		opts = append(opts, stub.WithPluginIdx(*idx))
	}
	if *socket != "" {
		opts = append(opts, stub.WithSocketPath(*socket))
	}
	s, err := stub.New(p, opts...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	p.stub = s
	if err := s.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
