package main

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

func firstLine(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

func countCPUs(list string) int {
	n := 0
	for _, part := range strings.Split(list, ",") {
		if part == "" {
			continue
		}
		if ab := strings.SplitN(part, "-", 2); len(ab) == 2 {
			a, _ := strconv.Atoi(ab[0])
			b, _ := strconv.Atoi(ab[1])
			n += b - a + 1
		} else {
			n++
		}
	}
	return n
}

func uptimeMs() int64 {
	f := strings.Fields(firstLine("/proc/uptime"))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return int64(v*1000 + 0.5)
}

func memTotalKiB() int64 {
	b, _ := os.ReadFile("/proc/meminfo")
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "MemTotal:") {
			f := strings.Fields(line)
			if len(f) >= 2 {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				return v
			}
		}
	}
	return 0
}

// nics lists the guest's network interfaces other than loopback, with their addresses as CIDRs:
// the host checks them against what it asked /init to configure.
func nics() []map[string]interface{} {
	out := []map[string]interface{}{}
	ifaces, err := net.Interfaces()
	if err != nil {
		return out
	}
	for _, ifc := range ifaces {
		if ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs := []string{}
		if list, err := ifc.Addrs(); err == nil {
			for _, a := range list {
				addrs = append(addrs, a.String())
			}
		}
		out = append(out, map[string]interface{}{
			"name": ifc.Name, "mac": ifc.HardwareAddr.String(), "addresses": addrs, "up": ifc.Flags&net.FlagUp != 0,
		})
	}
	return out
}

// report is the guest's description of itself (the body of hello and of the report op).
func report() map[string]interface{} {
	hp := map[string]interface{}{}
	dirs, _ := filepath.Glob("/sys/kernel/mm/hugepages/hugepages-*kB")
	for _, d := range dirs {
		size := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(d), "hugepages-"), "kB")
		if _, err := strconv.Atoi(size); err != nil {
			continue
		}
		total, _ := strconv.Atoi(firstLine(d + "/nr_hugepages"))
		free, _ := strconv.Atoi(firstLine(d + "/free_hugepages"))
		hp[size] = map[string]int{"total": total, "free": free}
	}
	body := map[string]interface{}{
		"agent":         "vmsandbox-agent/4",
		"protocol":      protocolVersion,
		"kernel":        firstLine("/proc/sys/kernel/osrelease"),
		"vcpus":         countCPUs(firstLine("/sys/devices/system/cpu/online")),
		"mem_total_kib": memTotalKiB(),
		"hugepages":     hp,
		"cmdline":       firstLine("/proc/cmdline"),
		"boot_ms":       uptimeMs(),
		"instance":      currentInstance(),
	}
	if name, err := os.Hostname(); err == nil {
		body["hostname"] = name
	}
	body["nics"] = nics()
	if errs := os.Getenv("BOOT_ERRORS"); errs != "" {
		body["errors"] = strings.Split(errs, "; ")
	}
	return body
}
