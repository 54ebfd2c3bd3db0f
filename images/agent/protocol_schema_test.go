package main

// The agent's side of the protocol against its schema (proto/agent/agent-protocol.schema.json, the
// host's side: tests/vmsandbox/test_agent_protocol_schema.py): the hello and the answer of each op,
// as the agent writes them on its port, are valid messages and valid results of their op, with
// every object closed (no field the schema does not declare); the args given are valid for the op;
// the ops the agent registers are the schema's, and so are its versions and bounds. Ops that need a
// guest (crun, mounts, the kernel's random pool) are skipped by name, each saying why; the others
// run here on containers, processes and sessions put in the agent's tables by hand.

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v5"
)

const schemaFile = "../../proto/agent/agent-protocol.schema.json"

// protocolSchema is the schema document and its definitions compiled on demand, open (as the
// readers take messages) and closed (as a writer must send them: only declared fields).
type protocolSchema struct {
	doc      map[string]interface{}
	compiler *jsonschema.Compiler
	compiled map[string]*jsonschema.Schema
}

func loadSchema(t *testing.T) *protocolSchema {
	t.Helper()
	data, err := os.ReadFile(schemaFile)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]interface{}
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	closed := closeShapes(doc).(map[string]interface{})
	closed["$id"] = "urn:vmsandbox:agent-protocol:closed"
	closedData, err := json.Marshal(closed)
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	c.Draft = jsonschema.Draft2020
	if err := c.AddResource("open.json", bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	if err := c.AddResource("closed.json", bytes.NewReader(closedData)); err != nil {
		t.Fatal(err)
	}
	return &protocolSchema{doc: doc, compiler: c, compiled: map[string]*jsonschema.Schema{}}
}

// closeShapes returns node with additionalProperties false in every object shape that declares its
// properties and says nothing of others.
func closeShapes(node interface{}) interface{} {
	switch n := node.(type) {
	case []interface{}:
		out := make([]interface{}, len(n))
		for i, v := range n {
			out[i] = closeShapes(v)
		}
		return out
	case map[string]interface{}:
		out := map[string]interface{}{}
		for k, v := range n {
			out[k] = closeShapes(v)
		}
		_, props := out["properties"]
		_, extra := out["additionalProperties"]
		if out["type"] == "object" && props && !extra {
			out["additionalProperties"] = false
		}
		return out
	}
	return node
}

func (s *protocolSchema) def(t *testing.T, name string, closed bool) *jsonschema.Schema {
	t.Helper()
	url := "open.json#/$defs/" + name
	if closed {
		url = "closed.json#/$defs/" + name
	}
	if sch, ok := s.compiled[url]; ok {
		return sch
	}
	sch, err := s.compiler.Compile(url)
	if err != nil {
		t.Fatalf("compile %s: %v", url, err)
	}
	s.compiled[url] = sch
	return sch
}

// decodeJSON is v as the schema validator reads it: numbers kept exact.
func decodeJSON(t *testing.T, data []byte) interface{} {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	var v interface{}
	if err := d.Decode(&v); err != nil {
		t.Fatalf("not JSON: %v: %.200s", err, data)
	}
	return v
}

func (s *protocolSchema) check(t *testing.T, name string, v interface{}) {
	t.Helper()
	if err := s.def(t, name, true).Validate(v); err != nil {
		out, _ := json.Marshal(v)
		t.Fatalf("not a valid %s: %#v\n%.600s", name, err, out)
	}
}

// portLine is the one line a port writes while write runs, read as the host reads it.
func portLine(t *testing.T, write func(p *port)) []byte {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(r); got <- b }()
	write(&port{f: w})
	w.Close()
	out := <-got
	r.Close()
	if len(out) == 0 || out[len(out)-1] != '\n' || bytes.Count(out, []byte("\n")) != 1 {
		t.Fatalf("not one line: %.300q", out)
	}
	return out
}

// opTest drives the agent's ops through its port and checks each answer against the schema.
type opTest struct {
	*protocolSchema
	t      *testing.T
	driven map[string]bool
}

// answer is the body of the agent's answer to op with args (which must be valid args of op).
func (o *opTest) answer(op string, args interface{}) map[string]interface{} {
	t := o.t
	t.Helper()
	raw, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	o.check(t, "args."+op, decodeJSON(t, raw))
	line := portLine(t, func(p *port) { p.answer(json.RawMessage(`"7"`), op, raw) })
	if len(line) > o.maxLine("guest-to-host-max-bytes") {
		t.Fatalf("%s: a line of %d bytes", op, len(line))
	}
	msg := decodeJSON(t, line).(map[string]interface{})
	o.check(t, "guestMessage", msg)
	if msg["ok"] != true || msg["id"] != "7" {
		t.Fatalf("%s: %v", op, msg)
	}
	body := msg["body"].(map[string]interface{})
	o.check(t, "result."+op, body)
	o.driven[op] = true
	return body
}

func (o *opTest) maxLine(key string) int {
	n, _ := o.doc["x-lines"].(map[string]interface{})[key].(float64)
	return int(n)
}

// skips are the ops not run here, each with the reason.
var skips = map[string]string{
	"create":      "create mounts the sandbox's 9p share and an overlay and runs /usr/bin/crun create: it needs a guest",
	"start":       "start runs /usr/bin/crun start on a created container: it needs a guest",
	"exec":        "exec runs /usr/bin/crun exec in a running container: it needs a guest (its answer, written by sendExec, is checked here)",
	"proc_start":  "proc_start runs /usr/bin/crun exec in a running container: it needs a guest",
	"personalize": "personalize reseeds the kernel's random pool, sets the clock, the hostname and a NIC: it needs a guest (it answers the report, checked here)",
}

func TestSchemaHelloAndAnswers(t *testing.T) {
	o := &opTest{protocolSchema: loadSchema(t), t: t, driven: map[string]bool{}}

	hello := decodeJSON(t, portLine(t, func(p *port) { p.send(helloMessage()) }))
	o.check(t, "guestMessage", hello)
	o.check(t, "hello", hello)

	o.answer("ping", map[string]interface{}{})
	o.answer("report", map[string]interface{}{})
	o.answer("poweroff", map[string]interface{}{})              // answer only: handle powers off after it
	o.answer("cpus_online", map[string]interface{}{"count": 1}) // cpu0 alone: nothing is written to /sys

	for _, part := range []struct {
		name string
		run  func()
	}{
		{"containers", o.containers}, {"streamed processes", o.procs}, {"forwarded connections", o.forwards},
		{"volume copies", o.volumes}, {"exec answer", o.execAnswer}, {"failures", o.failures},
	} {
		t.Run(part.name, func(sub *testing.T) {
			o.t = sub
			defer func() { o.t = t }()
			part.run()
		})
	}

	var missing []string
	for op := range handlers {
		if !o.driven[op] && skips[op] == "" {
			missing = append(missing, op)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("ops neither driven nor skipped with a reason: %v", missing)
	}
	for op, why := range skips {
		if handlers[op] == nil {
			t.Errorf("%s is skipped but not an op of the agent", op)
		}
		t.Logf("not run: %s: %s", op, why)
	}
}

// putContainer adds a container to the agent's table as a create would have left it.
func (o *opTest) putContainer(id, state string) *container {
	c := &container{ID: id, State: state, Pid: 4242, CreatedAt: time.Now().UnixNano(), cgroup: "/vmsandbox/" + id,
		spec: map[string]interface{}{"process": map[string]interface{}{"args": []interface{}{"sh"}}},
		log:  newLogBuffer(2), done: make(chan struct{}), made: make(chan struct{})}
	close(c.made)
	if state == "exited" {
		c.ExitCode, c.Signal, c.OOMKilled, c.FinishedAt = 137, 9, true, time.Now().UnixNano()
		close(c.done)
	}
	cmu.Lock()
	containers[id] = c
	cmu.Unlock()
	o.t.Cleanup(func() { cmu.Lock(); delete(containers, id); cmu.Unlock() })
	return c
}

func (o *opTest) containers() {
	t := o.t
	run := o.putContainer("schema-running", "running")
	o.putContainer("schema-exited", "exited")
	id := func(cid string) map[string]interface{} { return map[string]interface{}{"id": cid} }

	o.answer("status", id(run.ID))
	if st := o.answer("wait", map[string]interface{}{"id": "schema-exited", "timeout_ms": 1000}); st["state"] != "exited" {
		t.Fatalf("wait: %v", st)
	}
	o.answer("kill", map[string]interface{}{"id": "schema-exited", "signal": "KILL"}) // exited: no crun
	if list := o.answer("list", map[string]interface{}{}); len(list["containers"].([]interface{})) < 2 {
		t.Fatalf("list: %v", list)
	}

	run.log.write(criRecord(time.Now(), "stdout", false, []byte("hello")))
	run.log.write(criRecord(time.Now(), "stderr", true, bytes.Repeat([]byte("x"), maxLogLine)))
	chunk := o.answer("log_read", map[string]interface{}{"id": run.ID, "offset": 0, "max_bytes": 1 << 20, "wait_ms": 0})
	if data, _ := base64.StdEncoding.DecodeString(chunk["data"].(string)); !bytes.Contains(data, []byte(" stdout F hello\n")) {
		t.Fatalf("log_read: %q", data)
	}

	o.answer("stats", map[string]interface{}{"id": ""})
	o.answer("stats", id(run.ID))
	// every reading the agent can send, from the cgroup files of a 6.1 guest kernel (metrics_test.go)
	s := cgroupStats("/vmsandbox/none")
	s["writable_bytes"], s["writable_inodes"] = int64(4096), int64(3)
	cgroupMetrics(writeCgroup(t, cgroupFixture), s)
	writableFS(t.TempDir(), s)
	line := portLine(t, func(p *port) { p.send(map[string]interface{}{"type": "response", "id": "7", "ok": true, "body": s}) })
	o.check(t, "result.stats", decodeJSON(t, line).(map[string]interface{})["body"])
	o.answer("update", map[string]interface{}{"id": run.ID, "files": map[string]string{}})

	// attach: the running container's stdio
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdinR.Close()
	run.stdinMu.Lock()
	run.stdin = stdinW
	run.stdinMu.Unlock()
	session := o.answer("attach_open", id(run.ID))["attach"].(string)
	attachTee(run, 0)([]byte("prompt$ "))
	o.answer("attach_read", map[string]interface{}{"attach": session, "max_bytes": 65536, "timeout_ms": 1000})
	o.answer("attach_read", map[string]interface{}{"attach": session, "max_bytes": 65536, "timeout_ms": 1})
	typed := o.answer("attach_write", map[string]interface{}{"attach": session,
		"data": base64.StdEncoding.EncodeToString([]byte("ls\n")), "timeout_ms": 1000})
	if n, _ := typed["written"].(json.Number).Int64(); n != 3 {
		t.Fatalf("attach_write: %v", typed)
	}
	if master := openPTY(t); master != nil {
		run.master = master
		o.answer("attach_resize", map[string]interface{}{"attach": session, "rows": 40, "cols": 120})
	}
	o.answer("attach_close_stdin", map[string]interface{}{"attach": session})
	o.answer("attach_release", map[string]interface{}{"attach": session})
	stdinW.Close()

	o.answer("delete", id("schema-exited")) // exited: crun delete fails and is logged; its state goes
}

// openPTY is a terminal's master (nil, with a log line, where this system has none).
func openPTY(t *testing.T) *os.File {
	f, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Logf("attach_resize and proc_resize not run: no terminal here: %v", err)
		return nil
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func (o *opTest) procs() {
	t := o.t
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdinR.Close()
	master := openPTY(t)
	src := &procSource{tty: true, stdin: stdinW, master: master, pidFile: filepath.Join(t.TempDir(), "pid")}
	p := newSession(2, procDrainGrace, src)
	p.out[0].buf = []byte("hello\n")
	p.out[1].eof = true
	id, err := procs.reserve()
	if err != nil {
		t.Fatal(err)
	}
	procs.add(id, p)
	h := map[string]interface{}{"proc": p.id}

	if out := o.answer("proc_read", map[string]interface{}{"proc": p.id, "max_bytes": 65536, "timeout_ms": 1000}); out["done"] != false {
		t.Fatalf("proc_read: %v", out)
	}
	o.answer("proc_write", map[string]interface{}{"proc": p.id, "data": base64.StdEncoding.EncodeToString([]byte("exit 3\n")),
		"timeout_ms": 1000})
	if master != nil {
		o.answer("proc_resize", map[string]interface{}{"proc": p.id, "rows": 24, "cols": 80})
	}
	src.mu.Lock()
	src.master = nil // the terminal is the test's to close
	src.mu.Unlock()
	o.answer("proc_close_stdin", h)
	stdinW.Close()
	if w := o.answer("proc_wait", map[string]interface{}{"proc": p.id, "timeout_ms": 1}); w["exited"] != false {
		t.Fatalf("proc_wait of a running process: %v", w)
	}
	p.mu.Lock()
	p.out[0].eof = true
	p.mu.Unlock()
	p.end(3)
	done := o.answer("proc_read", map[string]interface{}{"proc": p.id, "max_bytes": 0, "timeout_ms": 1000})
	if done["done"] != true || done["exit_code"] != json.Number("3") {
		t.Fatalf("proc_read of a finished process: %v", done)
	}
	o.answer("proc_wait", map[string]interface{}{"proc": p.id, "timeout_ms": 1000})
	o.answer("proc_release", h)
	o.answer("proc_release", h) // a process already gone
}

func (o *opTest) forwards() {
	t := o.t
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	served := make(chan []byte, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			served <- nil
			return
		}
		c.Write([]byte("HTTP/1.1 200 OK\r\n\r\n"))
		b, _ := io.ReadAll(c)
		c.Close()
		served <- b
	}()
	conn := o.answer("tcp_connect", map[string]interface{}{"port": l.Addr().(*net.TCPAddr).Port})["conn"].(string)
	h := map[string]interface{}{"conn": conn}
	o.answer("tcp_read", map[string]interface{}{"conn": conn, "max_bytes": 65536, "timeout_ms": 5000})
	o.answer("tcp_write", map[string]interface{}{"conn": conn, "data": base64.StdEncoding.EncodeToString([]byte("GET / HTTP/1.1\r\n\r\n")),
		"timeout_ms": 1000})
	o.answer("tcp_close_write", h)
	if got := <-served; string(got) != "GET / HTTP/1.1\r\n\r\n" {
		t.Fatalf("the guest's server read %q", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if end := o.answer("tcp_read", map[string]interface{}{"conn": conn, "max_bytes": 65536, "timeout_ms": 1000}); end["eof"] == true {
			break // data null: nothing more
		}
	}
	o.answer("tcp_close", h)
}

func (o *opTest) volumes() {
	t := o.t
	saved := volumesDir
	volumesDir = t.TempDir()
	defer func() { volumesDir = saved }()
	uid, gid := os.Getuid(), os.Getgid()
	version := "..2026_01_01_00_00_00.123"
	vol := map[string]interface{}{"volume": testVolume, "version": version}
	if begun := o.answer("volume_begin", vol); begun["current"] != false {
		t.Fatalf("volume_begin: %v", begun)
	}
	part := func(offset int, data string) map[string]interface{} {
		return map[string]interface{}{"path": "nested/key", "type": "file", "offset": offset,
			"data": base64.StdEncoding.EncodeToString([]byte(data)), "mode": 0o640, "uid": uid, "gid": gid}
	}
	o.answer("volume_write", map[string]interface{}{"volume": testVolume, "version": version, "entries": []interface{}{
		map[string]interface{}{"path": "nested", "type": "dir", "mode": 0o755, "uid": uid, "gid": gid}, part(0, "n1")}})
	o.answer("volume_write", map[string]interface{}{"volume": testVolume, "version": version, "entries": []interface{}{part(2, "\n")}})
	meta := map[string]interface{}{"mode": 0o755, "uid": uid, "gid": gid}
	o.answer("volume_commit", map[string]interface{}{"volume": testVolume, "version": version, "root": meta, "top": meta,
		"names": []string{"nested"}})
	if got := readVolume(t, "nested/key"); got != "n1\n" {
		t.Fatalf("the volume holds %q", got)
	}
	if begun := o.answer("volume_begin", vol); begun["current"] != true {
		t.Fatalf("volume_begin of the committed version: %v", begun)
	}
	o.answer("volume_remove", map[string]interface{}{"volume": testVolume})
}

// execAnswer checks the exec answer as sendExec writes it, streamed, with more output than the
// port's buffer holds.
func (o *opTest) execAnswer() {
	t := o.t
	body := &execBody{
		fields: map[string]interface{}{"exit_code": 0, "timed_out": false, "dropped_bytes": int64(12),
			"duration_ns": int64(3021000)},
		stdout: bytes.Repeat([]byte("0123456789abcdef"), 20000),
		stderr: nil,
	}
	line := portLine(t, func(p *port) { p.sendExec(json.RawMessage(`"7"`), body) })
	msg := decodeJSON(t, line).(map[string]interface{})
	o.check(t, "guestMessage", msg)
	o.check(t, "result.exec", msg["body"])
}

// failures checks the failure answers: an op's, an unknown container's (with its code), an
// unknown op's, and one that answers no request (id null).
func (o *opTest) failures() {
	t := o.t
	for _, c := range []struct {
		op, args, code string
	}{
		{"status", `{"id":"no-such-container"}`, "unknown_container"},
		{"log_read", `{"id":"no-such-container","offset":0,"max_bytes":1}`, "unknown_container"},
		{"tcp_connect", `{"port":0}`, ""},
		{"volume_begin", `{"volume":"x","version":"..1"}`, ""},
		{"dance", `{}`, ""},
	} {
		line := portLine(t, func(p *port) { p.answer(json.RawMessage(`"8"`), c.op, json.RawMessage(c.args)) })
		msg := decodeJSON(t, line).(map[string]interface{})
		o.check(t, "guestMessage", msg)
		if msg["ok"] != false || msg["id"] != "8" || (msg["code"] != nil) != (c.code != "") {
			t.Fatalf("%s %s: %v", c.op, c.args, msg)
		}
	}
	for _, failure := range []func(p *port){
		func(p *port) { p.fail(nil, "unparsable message: invalid character") },
		func(p *port) { p.fail(nil, errLineTooLong.Error()) },
	} {
		o.check(t, "guestMessage", decodeJSON(t, portLine(t, failure)))
	}
}

// The ops the agent registers are the schema's, and its version, line bound, ids and bounds are
// the schema's too.
func TestSchemaOpsVersionsAndBounds(t *testing.T) {
	s := loadSchema(t)
	defs := s.doc["$defs"].(map[string]interface{})
	prop := func(def string, path ...string) map[string]interface{} {
		node := defs[def].(map[string]interface{})
		for _, p := range path {
			node = node["properties"].(map[string]interface{})[p].(map[string]interface{})
		}
		return node
	}
	var schemaOps, agentOps []string
	for _, op := range prop("request", "op")["enum"].([]interface{}) {
		schemaOps = append(schemaOps, op.(string))
	}
	for op := range handlers {
		agentOps = append(agentOps, op)
	}
	sort.Strings(schemaOps)
	sort.Strings(agentOps)
	if !reflect.DeepEqual(schemaOps, agentOps) {
		t.Errorf("the schema's ops %v\nthe agent's ops    %v", schemaOps, agentOps)
	}
	for _, op := range s.doc["x-agent-only-ops"].([]interface{}) {
		if handlers[op.(string)] == nil {
			t.Errorf("x-agent-only-ops names %s, which the agent does not register", op)
		}
	}

	num := func(v interface{}) int { f, _ := v.(float64); return int(f) }
	b64 := func(n int) int { return 4 * ((n + 2) / 3) }
	proto := s.doc["x-protocol"].(map[string]interface{})
	lines := s.doc["x-lines"].(map[string]interface{})
	for _, c := range []struct {
		what        string
		schema, got interface{}
	}{
		{"x-protocol.version", num(proto["version"]), protocolVersion},
		{"$defs/version maximum", num(defs["version"].(map[string]interface{})["maximum"]), protocolVersion},
		{"x-lines host-to-guest-max-bytes", num(lines["host-to-guest-max-bytes"]), maxLine},
		{"containerId pattern", defs["containerId"].(map[string]interface{})["pattern"], idPattern.String()},
		{"volumeId pattern", defs["volumeId"].(map[string]interface{})["pattern"], volumeIDPattern.String()},
		{"volumeVersion pattern", defs["volumeVersion"].(map[string]interface{})["pattern"], versionPattern.String()},
		{"proc_write data", num(prop("args.proc_write", "data")["maxLength"]), b64(sessionWriteMax)},
		{"attach_write data", num(prop("args.attach_write", "data")["maxLength"]), b64(sessionWriteMax)},
		{"tcp_write data", num(prop("args.tcp_write", "data")["maxLength"]), b64(sessionWriteMax)},
		{"log_read data", num(prop("result.log_read", "data")["maxLength"]), b64(logReadMax)},
		{"proc_read stdout", num(prop("result.proc_read", "stdout")["maxLength"]), b64(sessionBufMax)},
		{"attach_read stdout", num(prop("result.attach_read", "stdout")["maxLength"]), b64(sessionBufMax)},
		{"tcp_read data", num(prop("result.tcp_read", "data")["maxLength"]), b64(sessionBufMax)},
		{"stats io", num(prop("result.stats", "io")["maxItems"]), maxIODevices},
		{"stats hugetlb", num(prop("result.stats", "hugetlb")["maxProperties"]), maxHugetlb},
	} {
		if !reflect.DeepEqual(c.schema, c.got) {
			t.Errorf("%s: the schema says %v, the agent %v", c.what, c.schema, c.got)
		}
	}
	var files []string
	for name := range cgroupFiles {
		files = append(files, name)
	}
	sort.Strings(files)
	names := prop("args.update", "files")["propertyNames"].(map[string]interface{})["anyOf"].([]interface{})
	var enum []string
	for _, f := range names[0].(map[string]interface{})["enum"].([]interface{}) {
		enum = append(enum, f.(string))
	}
	if !reflect.DeepEqual(enum, files) {
		t.Errorf("update's files: the schema says %v, the agent writes %v", enum, files)
	}
}

// The schema's own examples of args and answers are valid (the host reads them in its test).
func TestSchemaExamplesAreValid(t *testing.T) {
	s := loadSchema(t)
	checked := 0
	for name, def := range s.doc["$defs"].(map[string]interface{}) {
		examples, _ := def.(map[string]interface{})["examples"].([]interface{})
		for _, ex := range examples {
			raw, _ := json.Marshal(ex)
			s.check(t, name, decodeJSON(t, raw))
			checked++
		}
	}
	if checked < 40 {
		t.Fatalf("only %d examples", checked)
	}
	// and the agent reads each example request
	for _, ex := range s.doc["$defs"].(map[string]interface{})["request"].(map[string]interface{})["examples"].([]interface{}) {
		raw, _ := json.Marshal(ex)
		var m message
		if err := json.Unmarshal(raw, &m); err != nil || m.Op == "" || handlers[m.Op] == nil {
			t.Fatalf("the agent cannot read %s: %v", raw, err)
		}
	}
}
