// netlink.go: the pod's NIC configured with rtnetlink requests of our own (link down, MAC, MTU,
// addresses, link up, routes), not `ip` processes: a guest restored from a snapshot runs with an
// empty TCG translation cache, where each fork and exec of busybox cost ~0.15 s, and personalize
// ran six or more of them.
package main

import (
	"fmt"
	"net"
	"syscall"
	"unsafe"
)

// rtnetlink constants not in package syscall
const (
	rtTableMain = 254
	rtProtBoot  = 3
	rtScopeLink = 253
	rtScopeUniv = 0
	rtnUnicast  = 1
)

// nlMsg is one request being built: the body after the netlink header, attributes appended.
type nlMsg struct{ b []byte }

func (m *nlMsg) u8(v uint8) { m.b = append(m.b, v) }

func (m *nlMsg) u16(v uint16) {
	var b [2]byte
	*(*uint16)(unsafe.Pointer(&b[0])) = v
	m.b = append(m.b, b[:]...)
}

func (m *nlMsg) u32(v uint32) {
	var b [4]byte
	*(*uint32)(unsafe.Pointer(&b[0])) = v
	m.b = append(m.b, b[:]...)
}

// attr appends an rtattr (length, type, data, padded to 4 bytes).
func (m *nlMsg) attr(typ uint16, data []byte) {
	m.u16(uint16(syscall.SizeofRtAttr + len(data)))
	m.u16(typ)
	m.b = append(m.b, data...)
	for len(m.b)%syscall.RTA_ALIGNTO != 0 {
		m.b = append(m.b, 0)
	}
}

func u32bytes(v uint32) []byte {
	var b [4]byte
	*(*uint32)(unsafe.Pointer(&b[0])) = v
	return b[:]
}

// rtnl sends one request and waits for the kernel's acknowledgement (its error, if any).
func rtnl(typ uint16, flags uint16, body []byte) error {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW|syscall.SOCK_CLOEXEC, syscall.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	sa := &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK}
	if err := syscall.Bind(fd, sa); err != nil {
		return err
	}
	hdr := nlMsg{}
	hdr.u32(uint32(syscall.NLMSG_HDRLEN + len(body)))
	hdr.u16(typ)
	hdr.u16(syscall.NLM_F_REQUEST | syscall.NLM_F_ACK | flags)
	hdr.u32(1) // sequence
	hdr.u32(0) // to the kernel
	if err := syscall.Sendto(fd, append(hdr.b, body...), 0, sa); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err != nil {
			return err
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Type != syscall.NLMSG_ERROR {
				continue
			}
			if len(m.Data) < 4 {
				return fmt.Errorf("short netlink acknowledgement")
			}
			if errno := *(*int32)(unsafe.Pointer(&m.Data[0])); errno != 0 {
				return syscall.Errno(-errno)
			}
			return nil
		}
	}
}

// setLink changes the link with index idx: its flags under change, and the given attributes.
func setLink(idx int, flags, change uint32, attrs func(*nlMsg)) error {
	m := nlMsg{}
	m.u8(syscall.AF_UNSPEC)
	m.u8(0)
	m.u16(0)
	m.u32(uint32(int32(idx)))
	m.u32(flags)
	m.u32(change)
	if attrs != nil {
		attrs(&m)
	}
	return rtnl(syscall.RTM_NEWLINK, 0, m.b)
}

func family(ip net.IP) (uint8, net.IP) {
	if v4 := ip.To4(); v4 != nil {
		return syscall.AF_INET, v4
	}
	return syscall.AF_INET6, ip.To16()
}

// addAddress gives the link an address (CIDR), as `ip addr add`.
func addAddress(idx int, cidr string) error {
	ip, ipnet, err := net.ParseCIDR(cidr)
	if err != nil {
		return err
	}
	ones, _ := ipnet.Mask.Size()
	fam, raw := family(ip)
	m := nlMsg{}
	m.u8(fam)
	m.u8(uint8(ones))
	m.u8(0)
	m.u8(rtScopeUniv)
	m.u32(uint32(int32(idx)))
	m.attr(syscall.IFA_LOCAL, raw)
	m.attr(syscall.IFA_ADDRESS, raw)
	return rtnl(syscall.RTM_NEWADDR, syscall.NLM_F_CREATE|syscall.NLM_F_EXCL, m.b)
}

// addRoute adds a route to dst (CIDR) through the link, via gw when given, as `ip route add`.
func addRoute(idx int, dst, gw string) error {
	_, ipnet, err := net.ParseCIDR(dst)
	if err != nil {
		return err
	}
	ones, _ := ipnet.Mask.Size()
	fam, raw := family(ipnet.IP)
	scope := uint8(rtScopeLink)
	var gwRaw net.IP
	if gw != "" {
		g := net.ParseIP(gw)
		if g == nil {
			return fmt.Errorf("bad gateway %q", gw)
		}
		gf, graw := family(g)
		if gf != fam {
			return fmt.Errorf("gateway %s is not of the family of %s", gw, dst)
		}
		gwRaw, scope = graw, rtScopeUniv
	}
	m := nlMsg{}
	m.u8(fam)
	m.u8(uint8(ones))
	m.u8(0) // src_len
	m.u8(0) // tos
	m.u8(rtTableMain)
	m.u8(rtProtBoot)
	m.u8(scope)
	m.u8(rtnUnicast)
	m.u32(0) // flags
	if ones > 0 {
		m.attr(syscall.RTA_DST, raw)
	}
	if gwRaw != nil {
		m.attr(syscall.RTA_GATEWAY, gwRaw)
	}
	m.attr(syscall.RTA_OIF, u32bytes(uint32(int32(idx))))
	return rtnl(syscall.RTM_NEWROUTE, syscall.NLM_F_CREATE|syscall.NLM_F_EXCL, m.b)
}
