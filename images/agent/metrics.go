package main

// The readings behind the CRI metrics (ListPodSandboxMetrics), added to a container's stats body:
// its cgroup v2 files, its processes' open descriptors and the file system of its writable layer.
// Every field is what a file says; a file this kernel does not have, or a value it spells in a
// way this code does not read, leaves its fields out, and the host leaves those metrics out.

import (
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
)

const (
	maxCgroupFile = 64 << 10 // bytes read of one cgroup file (memory.stat is about 2 KiB)
	maxIODevices  = 32       // io.stat lines reported
	maxHugetlb    = 8        // hugepage sizes reported
	maxProcs      = 4096     // processes whose descriptors are counted
	maxFDs        = 1 << 20  // descriptors looked at, over all of them
)

var hugetlbCurrent = regexp.MustCompile(`^hugetlb\.([0-9]{1,6}[KMG]B)\.current$`)

// readCgroupFile is a cgroup file's text, at most maxCgroupFile bytes; ok false when unreadable.
func readCgroupFile(path string) (string, bool) {
	f, err := os.Open(path)
	if err != nil {
		return "", false
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxCgroupFile))
	if err != nil {
		return "", false
	}
	return string(b), true
}

// parseFlatKeyed reads "key value" lines (cpu.stat, memory.stat, memory.events); lines of another
// shape and values that are not non-negative integers are left out.
func parseFlatKeyed(text string) map[string]int64 {
	out := map[string]int64{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if v, err := strconv.ParseInt(f[1], 10, 64); err == nil && v >= 0 {
			out[f[0]] = v
		}
	}
	return out
}

// parseSingle reads a file of one value: a non-negative integer, or "max" (unlimited: ok, max true).
func parseSingle(text string) (v int64, max bool, ok bool) {
	s := strings.TrimSpace(text)
	if s == "max" {
		return 0, true, true
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 {
		return 0, false, false
	}
	return v, false, true
}

// parsePressure reads a PSI file ("some avg10=.. avg60=.. avg300=.. total=N", "full ..."): the
// totals in microseconds by line kind.
func parsePressure(text string) map[string]int64 {
	out := map[string]int64{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || (f[0] != "some" && f[0] != "full") {
			continue
		}
		for _, kv := range f[1:] {
			if strings.HasPrefix(kv, "total=") {
				if v, err := strconv.ParseInt(kv[len("total="):], 10, 64); err == nil && v >= 0 {
					out[f[0]] = v
				}
			}
		}
	}
	return out
}

// parseIOStat reads io.stat: one entry per device ("MAJ:MIN rbytes=.. wbytes=.. rios=.. wios=.."),
// at most maxIODevices of them.
func parseIOStat(text string) []map[string]int64 {
	out := []map[string]int64{}
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || len(out) == maxIODevices {
			continue
		}
		mm := strings.SplitN(f[0], ":", 2)
		if len(mm) != 2 {
			continue
		}
		major, err1 := strconv.ParseInt(mm[0], 10, 32)
		minor, err2 := strconv.ParseInt(mm[1], 10, 32)
		if err1 != nil || err2 != nil || major < 0 || minor < 0 {
			continue
		}
		e := map[string]int64{"major": major, "minor": minor, "rbytes": 0, "wbytes": 0, "rios": 0, "wios": 0}
		for _, kv := range f[1:] {
			k, v, found := strings.Cut(kv, "=")
			if _, want := e[k]; !found || !want || k == "major" || k == "minor" {
				continue
			}
			if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
				e[k] = n
			}
		}
		out = append(out, e)
	}
	return out
}

// copyKeys sets s[to] = from[key] for each key of names (key -> to) that from has.
func copyKeys(s map[string]interface{}, from map[string]int64, names map[string]string) {
	for key, to := range names {
		if v, ok := from[key]; ok {
			s[to] = v
		}
	}
}

// cgroupMetrics adds to s what the cgroup directory dir says beyond the basic stats.
func cgroupMetrics(dir string, s map[string]interface{}) {
	if text, ok := readCgroupFile(dir + "/cpu.stat"); ok {
		copyKeys(s, parseFlatKeyed(text), map[string]string{
			"user_usec": "cpu_user_usec", "system_usec": "cpu_system_usec", "nr_periods": "cpu_nr_periods",
			"nr_throttled": "cpu_nr_throttled", "throttled_usec": "cpu_throttled_usec",
		})
	}
	if text, ok := readCgroupFile(dir + "/memory.stat"); ok {
		copyKeys(s, parseFlatKeyed(text), map[string]string{
			"file": "memory_file", "file_mapped": "memory_file_mapped", "kernel": "memory_kernel",
			"active_file": "memory_active_file", "inactive_file": "memory_inactive_file",
		})
	}
	if text, ok := readCgroupFile(dir + "/memory.events"); ok {
		copyKeys(s, parseFlatKeyed(text), map[string]string{"max": "memory_events_max", "oom": "memory_events_oom"})
	}
	// usage figures: a number, never "max"
	for file, key := range map[string]string{"memory.peak": "memory_peak", "memory.swap.current": "memory_swap_current"} {
		if text, ok := readCgroupFile(dir + "/" + file); ok {
			if v, max, ok := parseSingle(text); ok && !max {
				s[key] = v
			}
		}
	}
	// limits: "max" (none) leaves the field out
	for file, key := range map[string]string{
		"memory.max": "memory_max", "memory.low": "memory_low", "memory.swap.max": "memory_swap_max",
		"cpu.weight": "cpu_weight",
	} {
		if text, ok := readCgroupFile(dir + "/" + file); ok {
			if v, max, ok := parseSingle(text); ok && !max {
				s[key] = v
			}
		}
	}
	// pids.max: 0 for no limit (the CRI metric's "infinity if value is zero")
	if text, ok := readCgroupFile(dir + "/pids.max"); ok {
		if v, max, ok := parseSingle(text); ok {
			if max {
				v = 0
			}
			s["pids_max"] = v
		}
	}
	// cpu.max: "QUOTA PERIOD", QUOTA "max" when there is none
	if text, ok := readCgroupFile(dir + "/cpu.max"); ok {
		if f := strings.Fields(text); len(f) == 2 {
			if q, max, ok := parseSingle(f[0]); ok && !max {
				s["cpu_max_quota_usec"] = q
			}
			if p, max, ok := parseSingle(f[1]); ok && !max {
				s["cpu_max_period_usec"] = p
			}
		}
	}
	for _, res := range []string{"cpu", "memory", "io"} {
		if text, ok := readCgroupFile(dir + "/" + res + ".pressure"); ok {
			copyKeys(s, parsePressure(text), map[string]string{
				"some": "psi_" + res + "_some_usec", "full": "psi_" + res + "_full_usec",
			})
		}
	}
	if text, ok := readCgroupFile(dir + "/io.stat"); ok {
		s["io"] = parseIOStat(text)
	}
	if names, err := filepath.Glob(dir + "/hugetlb.*.current"); err == nil {
		sizes := map[string]int64{}
		for _, name := range names {
			m := hugetlbCurrent.FindStringSubmatch(filepath.Base(name))
			if m == nil || len(sizes) == maxHugetlb {
				continue
			}
			if text, ok := readCgroupFile(name); ok {
				if v, max, ok := parseSingle(text); ok && !max {
					sizes[m[1]] = v
				}
			}
		}
		if len(sizes) > 0 {
			s["hugetlb"] = sizes
		}
	}
	if text, ok := readCgroupFile(dir + "/cgroup.procs"); ok {
		pids := []int{}
		for _, line := range strings.Split(text, "\n") {
			if pid, err := strconv.Atoi(strings.TrimSpace(line)); err == nil && pid > 0 {
				pids = append(pids, pid)
			}
		}
		s["processes"] = int64(len(pids))
		if len(pids) > maxProcs {
			pids = pids[:maxProcs]
		}
		fds, sockets := countDescriptors("/proc", pids)
		s["file_descriptors"] = fds
		s["sockets"] = sockets
	}
}

// countDescriptors counts the open descriptors of the processes pids (under procRoot), and those
// of them that are sockets; a process gone meanwhile counts none; at most maxFDs are looked at.
func countDescriptors(procRoot string, pids []int) (fds, sockets int64) {
	for _, pid := range pids {
		dir := filepath.Join(procRoot, strconv.Itoa(pid), "fd")
		d, err := os.Open(dir)
		if err != nil {
			continue
		}
		names, _ := d.Readdirnames(int(maxFDs - fds))
		d.Close()
		for _, name := range names {
			fds++
			if target, err := os.Readlink(filepath.Join(dir, name)); err == nil && strings.HasPrefix(target, "socket:") {
				sockets++
			}
		}
		if fds >= maxFDs {
			break
		}
	}
	return fds, sockets
}

// writableFS adds the size and inodes of the file system holding a container's writable layer.
func writableFS(upper string, s map[string]interface{}) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(upper, &st); err != nil {
		return
	}
	s["fs_bytes"] = int64(st.Blocks) * st.Bsize
	s["fs_inodes"] = int64(st.Files)
	s["fs_inodes_free"] = int64(st.Ffree)
}
