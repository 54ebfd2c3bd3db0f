// personalize: make a guest restored from a snapshot this pod's (protocol version 4).
//
// Every guest restored from one snapshot starts as the same saved guest: the same kernel random
// pool, clock, hostname, agent instance and no pod network. The host sends what makes it this
// pod's; the agent applies it in an order that matters: the random pool first (reseeded from the
// host's bytes, so that nothing after it, the new instance id included, comes from the pool every
// clone shares), then the clock, the instance id, the hostname and the NIC.
package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

type personalizeNic struct {
	FromMAC   string   `json:"from_mac"`
	MAC       string   `json:"mac"`
	Addresses []string `json:"addresses"`
	Routes    []struct {
		Dst string `json:"dst"`
		Gw  string `json:"gw"`
	} `json:"routes"`
	MTU int `json:"mtu"`
}

type personalizeArgs struct {
	Seed     string          `json:"seed"`
	TimeNs   int64           `json:"time_ns"`
	Hostname string          `json:"hostname"`
	Nic      *personalizeNic `json:"nic"`
}

// ioctls of <linux/random.h>
const (
	rndAddEntropy = 0x40085203 // _IOW('R', 0x03, int[2])
	rndReseedCrng = 0x5207     // _IO('R', 0x07)
)

// reseed mixes seed into the kernel's pool, credits it, and makes the kernel rekey its CRNG now
// (RNDADDENTROPY alone only feeds the pool; the CRNG would keep its saved key until its next reseed).
func reseed(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	buf := make([]byte, 8+len(seed))
	*(*int32)(unsafe.Pointer(&buf[0])) = int32(len(seed) * 8)
	*(*int32)(unsafe.Pointer(&buf[4])) = int32(len(seed))
	copy(buf[8:], seed)
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), rndAddEntropy, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
		return fmt.Errorf("RNDADDENTROPY: %v", e)
	}
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), rndReseedCrng, 0); e != 0 {
		return fmt.Errorf("RNDRESEEDCRNG: %v", e)
	}
	return nil
}

func nicByMAC(mac string) string {
	files, _ := filepath.Glob("/sys/class/net/*/address")
	for _, f := range files {
		if strings.EqualFold(firstLine(f), mac) {
			return filepath.Base(filepath.Dir(f))
		}
	}
	return ""
}

// step is one change of the NIC's configuration, named as `ip` would be told it (for errors).
type step struct {
	what string
	do   func() error
}

func configureNic(n *personalizeNic) error {
	dev := nicByMAC(n.FromMAC)
	if dev == "" {
		dev = nicByMAC(n.MAC)
	}
	if dev == "" {
		return fmt.Errorf("no NIC with MAC %s", n.FromMAC)
	}
	ifc, err := net.InterfaceByName(dev)
	if err != nil {
		return err
	}
	idx := ifc.Index
	mac, err := net.ParseMAC(n.MAC)
	if err != nil || len(mac) != 6 {
		return fmt.Errorf("bad MAC %q", n.MAC)
	}
	steps := []step{
		{"link set dev " + dev + " down", func() error { return setLink(idx, 0, syscall.IFF_UP, nil) }},
		{"link set dev " + dev + " address " + n.MAC, func() error {
			return setLink(idx, 0, 0, func(m *nlMsg) { m.attr(syscall.IFLA_ADDRESS, mac) })
		}},
	}
	if n.MTU > 0 {
		mtu := uint32(n.MTU)
		steps = append(steps, step{fmt.Sprintf("link set dev %s mtu %d", dev, n.MTU), func() error {
			return setLink(idx, 0, 0, func(m *nlMsg) { m.attr(syscall.IFLA_MTU, u32bytes(mtu)) })
		}})
	}
	for _, a := range n.Addresses {
		a := a
		steps = append(steps, step{"addr add " + a + " dev " + dev, func() error { return addAddress(idx, a) }})
	}
	steps = append(steps, step{"link set dev " + dev + " up", func() error {
		return setLink(idx, syscall.IFF_UP, syscall.IFF_UP, nil)
	}})
	for _, r := range n.Routes {
		r := r
		what := "route add " + r.Dst + " dev " + dev
		if r.Gw != "" {
			what = "route add " + r.Dst + " via " + r.Gw + " dev " + dev
		}
		steps = append(steps, step{what, func() error { return addRoute(idx, r.Dst, r.Gw) }})
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			return fmt.Errorf("ip %s: %v", s.what, err)
		}
	}
	return nil
}

func init() {
	handlers["personalize"] = func(raw json.RawMessage) (interface{}, error) {
		var a personalizeArgs
		if err := json.Unmarshal(raw, &a); err != nil {
			return nil, fmt.Errorf("personalize: bad arguments: %v", err)
		}
		seed, err := base64.StdEncoding.DecodeString(a.Seed)
		if err != nil || len(seed) < 32 || len(seed) > 4096 {
			return nil, fmt.Errorf("personalize: seed must be 32 to 4096 bytes of base64")
		}
		if err := reseed(seed); err != nil {
			return nil, fmt.Errorf("personalize: %v", err)
		}
		if a.TimeNs > 0 {
			tv := syscall.NsecToTimeval(a.TimeNs)
			if err := syscall.Settimeofday(&tv); err != nil {
				return nil, fmt.Errorf("personalize: set the clock: %v", err)
			}
		}
		fresh := newInstance() // from the reseeded pool
		instanceMu.Lock()
		instance = fresh
		instanceMu.Unlock()
		if a.Hostname != "" {
			if err := syscall.Sethostname([]byte(a.Hostname)); err != nil {
				return nil, fmt.Errorf("personalize: hostname %s: %v", a.Hostname, err)
			}
		}
		if a.Nic != nil {
			if err := configureNic(a.Nic); err != nil {
				return nil, fmt.Errorf("network: %v", err)
			}
		}
		logf("personalized at %s: agent %s", time.Now().UTC().Format(time.RFC3339Nano), fresh)
		return report(), nil
	}
}
