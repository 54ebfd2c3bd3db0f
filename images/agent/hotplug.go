// hotplug.go: vCPUs and memory the host plugs into the running guest (a resize into the pod's
// resize headroom) are brought online here, as udev would on a distribution: on every kernel
// uevent of the cpu or memory subsystem, each present but offline CPU and memory block is onlined.
// Memory is also onlined by the kernel itself (memhp_default_state=online on the command line of
// guests with memory headroom); the host waits for the report's vcpus and mem_total_kib to grow.
package main

import (
	"bytes"
	"os"
	"path/filepath"
	"syscall"
)

// onlineHotplugged onlines every offline CPU and memory block under sysRoot; it returns how many.
func onlineHotplugged(sysRoot string) int {
	n := 0
	cpus, _ := filepath.Glob(filepath.Join(sysRoot, "devices/system/cpu/cpu[0-9]*/online"))
	for _, f := range cpus {
		if firstLine(f) == "0" && os.WriteFile(f, []byte("1"), 0) == nil {
			n++
		}
	}
	blocks, _ := filepath.Glob(filepath.Join(sysRoot, "devices/system/memory/memory[0-9]*/state"))
	for _, f := range blocks {
		if firstLine(f) == "offline" && os.WriteFile(f, []byte("online"), 0) == nil {
			n++
		}
	}
	return n
}

// hotplugEvent says whether a kernel uevent ("ACTION@DEVPATH\0KEY=VALUE\0...") adds a CPU or memory.
func hotplugEvent(msg []byte) bool {
	head, _, _ := bytes.Cut(msg, []byte{0})
	return bytes.HasPrefix(head, []byte("add@/devices/system/cpu/")) ||
		bytes.HasPrefix(head, []byte("add@/devices/system/memory/")) ||
		bytes.HasPrefix(head, []byte("online@/devices/system/cpu/"))
}

// watchHotplug listens to the kernel's uevents and onlines what is plugged; it returns only when
// the socket cannot be had (the guest then keeps what it booted with, which the host sees).
func watchHotplug() {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_DGRAM|syscall.SOCK_CLOEXEC, syscall.NETLINK_KOBJECT_UEVENT)
	if err != nil {
		logf("hot-plug: uevent socket: %v", err)
		return
	}
	defer syscall.Close(fd)
	if err := syscall.Bind(fd, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK, Groups: 1}); err != nil {
		logf("hot-plug: bind uevents: %v", err)
		return
	}
	onlineHotplugged("/sys") // anything plugged before this agent started
	buf := make([]byte, 16<<10)
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err == syscall.EINTR || err == syscall.ENOBUFS {
			onlineHotplugged("/sys") // events may have been dropped: look at everything
			continue
		}
		if err != nil {
			logf("hot-plug: read uevents: %v", err)
			return
		}
		if hotplugEvent(buf[:n]) {
			onlineHotplugged("/sys")
		}
	}
}
