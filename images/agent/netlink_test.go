package main

import (
	"bytes"
	"net"
	"syscall"
	"testing"
)

func TestAttributesArePaddedToFourBytes(t *testing.T) {
	cases := []struct {
		data []byte
		want []byte
	}{
		{[]byte{1, 2, 3, 4}, []byte{8, 0, 1, 0, 1, 2, 3, 4}},
		{[]byte{0x52, 0x54, 0, 0, 0x5a, 0xfe}, []byte{10, 0, 1, 0, 0x52, 0x54, 0, 0, 0x5a, 0xfe, 0, 0}},
		{[]byte{}, []byte{4, 0, 1, 0}},
	}
	for _, c := range cases {
		m := nlMsg{}
		m.attr(1, c.data)
		if !bytes.Equal(m.b, c.want) {
			t.Errorf("attr(%v) = %v, want %v", c.data, m.b, c.want)
		}
	}
}

func TestBadAddressesAndRoutesAreRefusedBeforeTheKernelIsAsked(t *testing.T) {
	if err := addAddress(1, "10.0.0.1"); err == nil {
		t.Error("an address without a prefix length was accepted")
	}
	for _, r := range []struct{ dst, gw string }{
		{"default", ""},
		{"0.0.0.0/0", "not-an-ip"},
		{"0.0.0.0/0", "fd00::1"},
	} {
		if err := addRoute(1, r.dst, r.gw); err == nil {
			t.Errorf("route %s via %q was accepted", r.dst, r.gw)
		}
	}
}

func TestFamilyOfAnAddress(t *testing.T) {
	for _, c := range []struct {
		ip   string
		fam  uint8
		size int
	}{{"10.0.2.15", syscall.AF_INET, 4}, {"fd00::5", syscall.AF_INET6, 16}} {
		fam, raw := family(parseIP(t, c.ip))
		if fam != c.fam || len(raw) != c.size {
			t.Errorf("family(%s) = %d, %d bytes", c.ip, fam, len(raw))
		}
	}
}

func parseIP(t *testing.T, s string) net.IP {
	t.Helper()
	ip := net.ParseIP(s)
	if ip == nil {
		t.Fatalf("bad test address %s", s)
	}
	return ip
}
