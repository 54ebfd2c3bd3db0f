// probe runs inside the cluster test's pods (runc and VM alike), where the image has busybox-static
// only: its wget has no TLS and its resolver is static glibc's. Built with CGO_ENABLED=0, probe
// resolves names with Go's own resolver, which reads the pod's /etc/resolv.conf.
//
//	probe api URL          GET URL with the pod's service-account token and CA; prints "status N"
//	                       and the body's first 4 KiB; exits 0 on any HTTP answer
//	probe dial HOST:PORT   connect (the name resolved through the pod's DNS), print what the peer
//	                       sends until it closes; exits 1 if no connection within 10 s
//	probe serve PORT TEXT  answer every TCP connection on PORT with TEXT and a newline, forever
package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

const serviceAccount = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if len(os.Args) < 3 {
		fail("usage: probe api URL | dial HOST:PORT | serve PORT TEXT")
	}
	var err error
	switch os.Args[1] {
	case "api":
		err = api(os.Args[2])
	case "dial":
		err = dial(os.Args[2])
	case "serve":
		if len(os.Args) < 4 {
			fail("usage: probe serve PORT TEXT")
		}
		err = serve(os.Args[2], strings.Join(os.Args[3:], " "))
	default:
		fail("unknown command " + os.Args[1])
	}
	if err != nil {
		fail(err.Error())
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "probe:", msg)
	os.Exit(1)
}

func api(url string) error {
	token, err := os.ReadFile(serviceAccount + "/token")
	if err != nil {
		return err
	}
	ca, err := os.ReadFile(serviceAccount + "/ca.crt")
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return fmt.Errorf("%s/ca.crt holds no certificate", serviceAccount)
	}
	client := &http.Client{
		Timeout:   20 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
	}
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	fmt.Printf("status %d\n%s\n", resp.StatusCode, body)
	return nil
}

func dial(addr string) error {
	conn, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	_, err = io.Copy(os.Stdout, conn)
	return err
}

func serve(port, text string) error {
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		return err
	}
	fmt.Printf("serving on :%s\n", port)
	for {
		conn, err := ln.Accept()
		if err != nil {
			return err
		}
		_, _ = fmt.Fprintln(conn, text)
		_ = conn.Close()
	}
}
