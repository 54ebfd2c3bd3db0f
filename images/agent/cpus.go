// cpus.go: the cpus_online op. A pod whose profile reserves vCPU headroom boots with every vCPU
// present (each with its QEMU thread from the start) and its kernel brings up the pod's own only
// (maxcpus= on its command line); a resize into the headroom asks for more CPUs online, and this
// onlines the present, offline ones through sysfs, cpu1 upwards. It never offlines a CPU, so the
// op is idempotent: a host that retries it after a crash asks for the same count again. Memory the
// host plugs (a DIMM) is onlined by the kernel itself (memhp_default_state=online on the command
// line of guests with memory headroom); the host waits for the report's vcpus and mem_total_kib.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// maxOnlineCPUs bounds cpus_online's count (the host's schema says the same).
const maxOnlineCPUs = 4096

// cpusOnline brings cpu1..cpu(count-1) under sysRoot online where they are offline; CPUs already
// online, and those beyond count, are left as they are. It returns how many CPUs are online after.
func cpusOnline(sysRoot string, count int) (int, error) {
	if count < 1 || count > maxOnlineCPUs {
		return 0, fmt.Errorf("cpus_online: count must be 1 to %d, got %d", maxOnlineCPUs, count)
	}
	base := filepath.Join(sysRoot, "devices/system/cpu")
	for i := 1; i < count; i++ {
		f := filepath.Join(base, "cpu"+strconv.Itoa(i), "online")
		switch firstLine(f) {
		case "1":
			continue
		case "0":
		default:
			return 0, fmt.Errorf("cpus_online: %d CPUs asked, cpu%d is not present (present: %s)",
				count, i, firstLine(filepath.Join(base, "present")))
		}
		w, err := os.OpenFile(f, os.O_WRONLY, 0) // sysfs: never created here
		if err == nil {
			_, err = w.Write([]byte("1"))
			if cerr := w.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			return 0, fmt.Errorf("cpus_online: cpu%d: %v", i, err)
		}
	}
	return countCPUs(firstLine(filepath.Join(base, "online"))), nil
}

// cpus_online: {"count"} -> {"online"}
func opCPUsOnline(raw json.RawMessage) (interface{}, error) {
	var a struct {
		Count int `json:"count"`
	}
	if err := json.Unmarshal(raw, &a); err != nil {
		return nil, fmt.Errorf("cpus_online: bad arguments: %v", err)
	}
	n, err := cpusOnline("/sys", a.Count)
	if err != nil {
		return nil, err
	}
	return map[string]interface{}{"online": n}, nil
}

func init() {
	handlers["cpus_online"] = opCPUsOnline
}
