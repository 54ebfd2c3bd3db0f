// splice relays every connection of a unix socket to another unix socket, byte for byte, without
// reading what passes: the least any process between a CRI client and its runtime can add
// (bench/proxy.py's floor). Usage: splice LISTEN-SOCKET TARGET-SOCKET
package main

import (
	"io"
	"log"
	"net"
	"os"
)

func main() {
	if len(os.Args) != 3 {
		log.Fatal("usage: splice LISTEN-SOCKET TARGET-SOCKET")
	}
	ln, err := net.Listen("unix", os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go func() {
			defer c.Close()
			d, err := net.Dial("unix", os.Args[2])
			if err != nil {
				return
			}
			defer d.Close()
			go func() { _, _ = io.Copy(d, c) }()
			_, _ = io.Copy(c, d)
		}()
	}
}
