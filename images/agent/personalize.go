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
	"os"
	"os/exec"
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

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func configureNic(n *personalizeNic) error {
	dev := nicByMAC(n.FromMAC)
	if dev == "" {
		dev = nicByMAC(n.MAC)
	}
	if dev == "" {
		return fmt.Errorf("no NIC with MAC %s", n.FromMAC)
	}
	steps := [][]string{{"link", "set", "dev", dev, "down"}, {"link", "set", "dev", dev, "address", n.MAC}}
	if n.MTU > 0 {
		steps = append(steps, []string{"link", "set", "dev", dev, "mtu", fmt.Sprint(n.MTU)})
	}
	for _, a := range n.Addresses {
		steps = append(steps, []string{"addr", "add", a, "dev", dev})
	}
	steps = append(steps, []string{"link", "set", "dev", dev, "up"})
	for _, r := range n.Routes {
		if r.Gw == "" {
			steps = append(steps, []string{"route", "add", r.Dst, "dev", dev})
		} else {
			steps = append(steps, []string{"route", "add", r.Dst, "via", r.Gw, "dev", dev})
		}
	}
	for _, s := range steps {
		if err := ipCmd(s...); err != nil {
			return err
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
