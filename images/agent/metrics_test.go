package main

import (
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"testing"
)

// a container cgroup as a 6.1 guest kernel writes it (trimmed where the agent reads nothing)
var cgroupFixture = map[string]string{
	"cpu.stat": "usage_usec 194684\nuser_usec 58772\nsystem_usec 135911\nnr_periods 6\nnr_throttled 2\n" +
		"throttled_usec 31000\nnr_bursts 0\nburst_usec 0\n",
	"memory.stat": "anon 163840\nfile 1769472\nkernel 348160\nkernel_stack 32768\nfile_mapped 1576960\n" +
		"inactive_file 188416\nactive_file 1581056\npgfault 673\npgmajfault 17\n",
	"memory.events":       "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n",
	"memory.peak":         "2555904\n",
	"memory.swap.current": "0\n",
	"memory.swap.max":     "0\n",
	"memory.max":          "67108864\n",
	"memory.low":          "0\n",
	"cpu.max":             "20000 100000\n",
	"cpu.weight":          "39\n",
	"pids.max":            "max\n",
	"io.stat": "254:0 rbytes=1748992 wbytes=4096 rios=21 wios=1 dbytes=0 dios=0\n" +
		"254:16 rbytes=512 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n",
	"cpu.pressure":        "some avg10=0.00 avg60=0.00 avg300=0.00 total=172938\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=154963\n",
	"memory.pressure":     "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
	"io.pressure":         "some avg10=1.50 avg60=0.20 avg300=0.00 total=6291\n",
	"hugetlb.2MB.current": "4194304\n",
	"hugetlb.1GB.current": "0\n",
	"hugetlb.2MB.max":     "max\n",
}

func writeCgroup(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestCgroupMetricsReadsTheFilesOfACgroup(t *testing.T) {
	s := map[string]interface{}{}
	cgroupMetrics(writeCgroup(t, cgroupFixture), s)
	want := map[string]int64{
		"cpu_user_usec": 58772, "cpu_system_usec": 135911, "cpu_nr_periods": 6, "cpu_nr_throttled": 2,
		"cpu_throttled_usec": 31000,
		"memory_file":        1769472, "memory_file_mapped": 1576960, "memory_kernel": 348160,
		"memory_active_file": 1581056, "memory_inactive_file": 188416,
		"memory_events_max": 4, "memory_events_oom": 1,
		"memory_peak": 2555904, "memory_swap_current": 0,
		"memory_max": 67108864, "memory_low": 0, "memory_swap_max": 0, "cpu_weight": 39,
		"pids_max":           0, // "max": no limit
		"cpu_max_quota_usec": 20000, "cpu_max_period_usec": 100000,
		"psi_cpu_some_usec": 172938, "psi_cpu_full_usec": 154963,
		"psi_memory_some_usec": 0, "psi_memory_full_usec": 0,
		"psi_io_some_usec": 6291, // no "full" line: left out
	}
	for key, v := range want {
		if s[key] != v {
			t.Errorf("%s = %v, want %d", key, s[key], v)
		}
	}
	if _, ok := s["psi_io_full_usec"]; ok {
		t.Error("psi_io_full_usec reported without a full line")
	}
	io := []map[string]int64{
		{"major": 254, "minor": 0, "rbytes": 1748992, "wbytes": 4096, "rios": 21, "wios": 1},
		{"major": 254, "minor": 16, "rbytes": 512, "wbytes": 0, "rios": 1, "wios": 0},
	}
	if !reflect.DeepEqual(s["io"], io) {
		t.Errorf("io = %v, want %v", s["io"], io)
	}
	if !reflect.DeepEqual(s["hugetlb"], map[string]int64{"2MB": 4194304, "1GB": 0}) {
		t.Errorf("hugetlb = %v", s["hugetlb"])
	}
	// no cgroup.procs in the fixture: no process counts
	for _, key := range []string{"processes", "file_descriptors", "sockets"} {
		if _, ok := s[key]; ok {
			t.Errorf("%s reported without cgroup.procs", key)
		}
	}
}

func TestCgroupMetricsLeavesOutWhatTheKernelDoesNotSay(t *testing.T) {
	s := map[string]interface{}{}
	cgroupMetrics(writeCgroup(t, map[string]string{
		"cpu.max":         "max 100000\n", // no quota
		"memory.max":      "max\n",
		"memory.swap.max": "max\n",
		"memory.peak":     "-5\n",               // not a count
		"memory.stat":     "anon x\nfile 1 2\n", // no field read
		"io.stat":         "garbage\n8:0 rbytes=-1 wbytes=7 nonsense\n",
	}), s)
	for _, key := range []string{"cpu_max_quota_usec", "memory_max", "memory_swap_max", "memory_peak",
		"memory_file", "cpu_user_usec", "pids_max", "hugetlb"} {
		if v, ok := s[key]; ok {
			t.Errorf("%s = %v, want it left out", key, v)
		}
	}
	if s["cpu_max_period_usec"] != int64(100000) {
		t.Errorf("cpu_max_period_usec = %v", s["cpu_max_period_usec"])
	}
	io := []map[string]int64{{"major": 8, "minor": 0, "rbytes": 0, "wbytes": 7, "rios": 0, "wios": 0}}
	if !reflect.DeepEqual(s["io"], io) {
		t.Errorf("io = %v, want %v", s["io"], io)
	}
}

func TestIOStatIsBounded(t *testing.T) {
	text := ""
	for i := 0; i < 3*maxIODevices; i++ {
		text += "8:" + strconv.Itoa(i) + " rbytes=1 wbytes=1 rios=1 wios=1\n"
	}
	if got := len(parseIOStat(text)); got != maxIODevices {
		t.Errorf("%d devices, want %d", got, maxIODevices)
	}
}

func TestDescriptorsAndSocketsOfTheCgroupsProcesses(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	files := map[string]string{"cgroup.procs": strconv.Itoa(os.Getpid()) + "\n999999999\n"}
	s := map[string]interface{}{}
	cgroupMetrics(writeCgroup(t, files), s)
	if s["processes"] != int64(2) {
		t.Errorf("processes = %v, want 2 (a pid gone meanwhile is still listed)", s["processes"])
	}
	fds, _ := s["file_descriptors"].(int64)
	sockets, _ := s["sockets"].(int64)
	if fds < 4 || sockets < 1 || sockets > fds {
		t.Errorf("file_descriptors %d, sockets %d: want this process's, with its listener", fds, sockets)
	}
}
