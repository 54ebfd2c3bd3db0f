# vmsandbox guest agent, message half (busybox awk). /init owns the channel and calls this once per
# message it sends or receives; protocol: images/README.md.
#
#   awk -v mode=hello -f agent.awk            prints the hello line
#   MSG=<line> awk -v mode=handle -f agent.awk
#                                             prints "<action> <response line>", action one of
#                                             reply | poweroff | ack (ack: nothing to send)
#
# Environment: HUGEPAGE_DIRS (the /sys/kernel/mm/hugepages/hugepages-*kB directories, space
# separated), BOOT_ERRORS (problems /init met, "; " separated).
#
# JSON strings from the host are kept in their raw (still escaped) form: an id is echoed back
# byte for byte, and an op or type spelled with escapes is simply not recognised.

BEGIN {
    for (k = 1; k < 32; k++) CTRL = CTRL sprintf("%c", k)
    if (mode == "hello") {
        print "{\"v\":1,\"type\":\"hello\",\"body\":" report_body() "}"
    } else if (mode == "handle") {
        handle(ENVIRON["MSG"])
    } else {
        print "agent.awk: unknown mode " mode > "/dev/stderr"
        exit 2
    }
}

# ---- the guest report -----------------------------------------------------------------------------

function first_line(path,    line) {
    line = ""
    if ((getline line < path) <= 0) line = ""
    close(path)
    return line
}

function count_cpus(list,    n, parts, i, ab, count) {
    # "0-1,3" -> 3
    count = 0
    n = split(list, parts, ",")
    for (i = 1; i <= n; i++) {
        if (parts[i] == "") continue
        if (split(parts[i], ab, "-") == 2) count += ab[2] - ab[1] + 1
        else count += 1
    }
    return count
}

function report_body(    kernel, cmdline, vcpus, mem, line, f, up, n, dirs, i, size, total, free, hp, sep, errs, ne, e) {
    kernel = first_line("/proc/sys/kernel/osrelease")
    cmdline = first_line("/proc/cmdline")
    vcpus = count_cpus(first_line("/sys/devices/system/cpu/online"))
    mem = 0
    while ((getline line < "/proc/meminfo") > 0) {
        if (line ~ /^MemTotal:/) { split(line, f, " "); mem = f[2] + 0; break }
    }
    close("/proc/meminfo")
    split(first_line("/proc/uptime"), f, " ")
    up = int(f[1] * 1000 + 0.5)

    hp = ""; sep = ""
    n = split(ENVIRON["HUGEPAGE_DIRS"], dirs, " ")
    for (i = 1; i <= n; i++) {
        size = dirs[i]
        sub(/.*hugepages-/, "", size)
        sub(/kB$/, "", size)
        if (size !~ /^[0-9]+$/) continue
        total = first_line(dirs[i] "/nr_hugepages") + 0
        free = first_line(dirs[i] "/free_hugepages") + 0
        hp = hp sep "\"" size "\":{\"total\":" total ",\"free\":" free "}"
        sep = ","
    }

    errs = ""
    if (ENVIRON["BOOT_ERRORS"] != "") {
        ne = split(ENVIRON["BOOT_ERRORS"], e, "; ")
        for (i = 1; i <= ne; i++) errs = errs (i > 1 ? "," : "") jstr(e[i])
        errs = ",\"errors\":[" errs "]"
    }

    return "{\"agent\":\"init/1\",\"kernel\":" jstr(kernel) ",\"vcpus\":" vcpus \
        ",\"mem_total_kib\":" mem ",\"hugepages\":{" hp "},\"cmdline\":" jstr(cmdline) \
        ",\"boot_ms\":" up errs "}"
}

# JSON string literal of s (bytes >= 0x20 other than " and \ pass through: UTF-8 stays UTF-8).
function jstr(s,    out, i, c, k) {
    out = ""
    for (i = 1; i <= length(s); i++) {
        c = substr(s, i, 1)
        if (c == "\"" || c == "\\") out = out "\\" c
        else if (c == "\n") out = out "\\n"
        else if (c == "\t") out = out "\\t"
        else if (c == "\r") out = out "\\r"
        else {
            k = index(CTRL, c)
            if (k > 0) out = out sprintf("\\u%04x", k)
            else out = out c
        }
    }
    return "\"" out "\""
}

# ---- a tiny JSON reader: one flat object, string values kept raw --------------------------------

function ws() {
    while (P <= N && index(" \t\r\n", substr(S, P, 1)) > 0) P++
}

# At a '"': returns the raw contents and leaves P after the closing quote; sets ERR on failure.
function raw_string(    start, c) {
    P++
    start = P
    while (P <= N) {
        c = substr(S, P, 1)
        if (c == "\"") { P++; return substr(S, start, P - 1 - start) }
        if (c == "\\") P += 2
        else P++
    }
    ERR = "unterminated string"
    return ""
}

# Skips any JSON value; returns its raw text ("s:<raw>" for a string) or sets ERR.
function value(    c, start, depth, q) {
    ws()
    c = substr(S, P, 1)
    if (c == "\"") return "s:" raw_string()
    start = P
    if (c == "{" || c == "[") {
        depth = 0
        while (P <= N) {
            c = substr(S, P, 1)
            if (c == "\"") { raw_string(); if (ERR != "") return ""; continue }
            if (c == "{" || c == "[") depth++
            else if (c == "}" || c == "]") { depth--; if (depth == 0) { P++; return substr(S, start, P - start) } }
            P++
        }
        ERR = "unterminated object or array"
        return ""
    }
    while (P <= N && index(",}] \t\r\n", substr(S, P, 1)) == 0) P++
    q = substr(S, start, P - start)
    if (q !~ /^(true|false|null|-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)$/) { ERR = "bad value"; return "" }
    return q
}

# Parses S into FIELD[key] = raw value; returns 1 on success, else 0 with ERR set.
function parse_object(    key, c) {
    P = 1; N = length(S); ERR = ""
    ws()
    if (substr(S, P, 1) != "{") { ERR = "not a JSON object"; return 0 }
    P++; ws()
    if (substr(S, P, 1) == "}") {
        P++; ws()
        if (P <= N) { ERR = "trailing data after the object"; return 0 }
        return 1
    }
    while (1) {
        ws()
        if (substr(S, P, 1) != "\"") { ERR = "expected a key"; return 0 }
        key = raw_string(); if (ERR != "") return 0
        ws()
        if (substr(S, P, 1) != ":") { ERR = "expected ':'"; return 0 }
        P++
        FIELD[key] = value(); if (ERR != "") return 0
        ws()
        c = substr(S, P, 1)
        P++
        if (c == "}") break
        if (c != ",") { ERR = "expected ',' or '}'"; return 0 }
    }
    ws()
    if (P <= N) { ERR = "trailing data after the object"; return 0 }
    return 1
}

# ---- requests --------------------------------------------------------------------------------------

function respond(action, id, ok, payload) {
    print action " {\"v\":1,\"type\":\"response\",\"id\":" id ",\"ok\":" ok "," payload "}"
}

function fail(id, message) {
    respond("reply", id, "false", "\"error\":" jstr(message))
}

function handle(line,    id, type, op) {
    S = line
    if (!parse_object()) { fail("null", "unparsable message: " ERR); return }
    id = "null"
    if ("id" in FIELD && FIELD["id"] ~ /^s:/) id = "\"" substr(FIELD["id"], 3) "\""
    if (FIELD["v"] != "1") { fail(id, "unsupported protocol version (want \"v\":1)"); return }
    type = FIELD["type"]
    if (type == "s:ack") { print "ack"; return }
    if (type != "s:request") { fail(id, "unexpected message type from the host: " substr(type, 3)); return }
    if (id == "null") { fail(id, "request without a string id"); return }
    op = FIELD["op"]
    if (op == "s:ping") respond("reply", id, "true", "\"body\":{}")
    else if (op == "s:report") respond("reply", id, "true", "\"body\":" report_body())
    else if (op == "s:poweroff") respond("poweroff", id, "true", "\"body\":{}")
    else if (op ~ /^s:/) fail(id, "unknown op: " substr(op, 3))
    else fail(id, "request without a string op")
}
