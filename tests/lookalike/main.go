// Command lookalike stands in for the programs of critest's web-server and nonewprivs images
// (tests/critest_images.py). What it does depends on the name it runs under (argv[0], else the
// name of its file, as for nginx, whose argv[0] is a process title):
//
//	nginx: writes its pid to /var/run/nginx.pid and serves a page on port 80, or on
//	       $LOOKALIKE_PORT (the host-network image's 12003) (the image's entrypoint gives it the
//	       title "nginx: master process ..." that critest looks for);
//	httpd: serves a page on port 80 and says so on stdout;
//	nnp:   prints "Effective uid: N" and exits (installed setuid root, so N tells whether the
//	       container's no_new_privs held);
//	pgrep: prints the pids of processes whose name matches its argument (busybox-static has no
//	       pgrep applet), exit status 1 when none does;
//	ipcs:  with -m, lists System V shared memory segments from /proc/sysvipc/shm (nor ipcs);
//	setcap: gives each file named a file capability (CAP_SETUID, effective), as libcap's
//	       `setcap cap_setuid+ep FILE` does, and says whether it held.
package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
)

var known = map[string]bool{"nginx": true, "httpd": true, "nnp": true, "pgrep": true, "ipcs": true, "setcap": true}

func main() {
	name := filepath.Base(os.Args[0])
	if !known[name] {
		exe, err := os.Executable()
		if err != nil {
			fmt.Fprintln(os.Stderr, "lookalike:", err)
			os.Exit(1)
		}
		name = filepath.Base(exe)
	}
	switch name {
	case "nnp":
		fmt.Printf("Effective uid: %d\n", os.Geteuid())
	case "nginx":
		pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
		if err := os.WriteFile("/var/run/nginx.pid", pid, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "nginx:", err)
			os.Exit(1)
		}
		serve(name, "<h1>Welcome to nginx!</h1>")
	case "httpd":
		serve(name, "<html><body><h1>It works!</h1></body></html>")
	case "pgrep":
		os.Exit(pgrep(os.Args[1:]))
	case "ipcs":
		os.Exit(ipcs(os.Args[1:]))
	case "setcap":
		os.Exit(setcap(os.Args[1:]))
	default:
		fmt.Fprintf(os.Stderr, "lookalike: run as nginx, httpd, nnp, pgrep, ipcs or setcap, not %q\n", name)
		os.Exit(2)
	}
}

func serve(name, page string) {
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Printf("%s: %s %s %s\n", name, r.RemoteAddr, r.Method, r.URL.Path)
		io.WriteString(w, page+"\n")
	})
	port := os.Getenv("LOOKALIKE_PORT")
	if port == "" {
		port = "80"
	}
	fmt.Printf("%s: listening on port %s\n", name, port)
	err := http.ListenAndServe(":"+port, nil)
	fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
	os.Exit(1)
}

func pgrep(args []string) int {
	if len(args) != 1 {
		fmt.Fprintln(os.Stderr, "usage: pgrep PATTERN")
		return 2
	}
	re, err := regexp.Compile(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, "pgrep:", err)
		return 2
	}
	self := strconv.Itoa(os.Getpid())
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	status := 1
	for _, d := range dirs {
		pid := filepath.Base(d)
		comm, err := os.ReadFile(d + "/comm")
		if err != nil || pid == self || !re.MatchString(strings.TrimSpace(string(comm))) {
			continue
		}
		fmt.Println(pid)
		status = 0
	}
	return status
}

func ipcs(args []string) int {
	if len(args) != 1 || args[0] != "-m" {
		fmt.Fprintln(os.Stderr, "usage: ipcs -m")
		return 2
	}
	fmt.Println("\n------ Shared Memory Segments --------")
	fmt.Printf("%-10s %-10s %-10s %-10s %-10s %-10s\n", "key", "shmid", "owner", "perms", "bytes", "nattch")
	f, err := os.Open("/proc/sysvipc/shm")
	if err != nil {
		return 0 // no System V IPC in this kernel: no segments
	}
	defer f.Close()
	lines := bufio.NewScanner(f)
	lines.Scan() // the header
	for lines.Scan() {
		// key shmid perms size cpid lpid nattch uid ...
		f := strings.Fields(lines.Text())
		if len(f) < 8 {
			continue
		}
		key, _ := strconv.ParseInt(f[0], 10, 64)
		perms, _ := strconv.ParseInt(f[2], 10, 64)
		fmt.Printf("0x%08x %-10s %-10s %-10o %-10s %-10s\n", uint32(key), f[1], f[7], perms&0o777, f[3], f[6])
	}
	return 0
}

// setcap writes a version 2 security.capability attribute (linux/capability.h: magic with the
// effective flag, then permitted and inheritable words, little-endian) granting CAP_SETUID.
func setcap(files []string) int {
	const capSetuid = 7
	value := make([]byte, 20)
	put := func(at int, v uint32) {
		for i := 0; i < 4; i++ {
			value[at+i] = byte(v >> (8 * i))
		}
	}
	put(0, 0x02000000|0x1)
	put(4, 1<<capSetuid)
	status := 0
	for _, f := range files {
		if err := syscall.Setxattr(f, "security.capability", value, 0); err != nil {
			fmt.Printf("setcap %s: %v\n", f, err)
			status = 1
			continue
		}
		fmt.Printf("setcap %s: done\n", f)
	}
	return status
}
