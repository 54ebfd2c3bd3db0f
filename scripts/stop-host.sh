#!/usr/bin/env bash
# Stop what scripts/setup-host.sh started: libvirtd (through its tini) and virtlogd, found by their
# pidfiles only. First, what killed runs left: every vmsandbox domain (ours by its metadata) whose
# state directory is gone has no shim left to adopt or remove it, and is destroyed and undefined
# (`python -m cli.teardown orphans`). Guests of a state that still exists are left alone
# (QEMU outlives libvirtd; a new libvirtd reconnects, and their shim adopts them). Hugepages stay
# reserved and hugetlbfs stays mounted. Safe to run again.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. "$SCRIPT_DIR/lib/common.sh"
STEP_TOTAL=4
PY=${VMSANDBOX_VENV:-$(dirname "$SCRIPT_DIR")/.venv}/bin/python

require_root

# guests whose state directory is gone, while libvirtd still answers
if ! live_pid "$LIBVIRTD_PIDFILE" libvirtd >/dev/null; then
    step 1 "orphaned guests" "libvirtd is not running: none looked for"
elif [[ ! -x $PY ]]; then
    step 1 "orphaned guests" "no venv at ${PY%/bin/python}: none looked for"
else
    rc=0
    out=$(cd "$(dirname "$SCRIPT_DIR")" && "$PY" -m cli.teardown orphans) || rc=$?
    [[ -z $out ]] || printf '  %s\n' "${out//$'\n'/$'\n'  }"
    ((rc == 0)) || warn "orphaned guests: not every one was removed (above)"
    step 1 "orphaned guests" "$(if [[ -n $out ]]; then wc -l <<<"$out"; else echo 0; fi) removed"
fi

# libvirtd: ours runs under tini (SIGTERM to tini is forwarded to libvirtd; tini exits after it).
if pid=$(live_pid "$LIBVIRTD_TINI_PIDFILE" tini); then
    lv=$(live_pid "$LIBVIRTD_PIDFILE" libvirtd || true)
    stop_pid "$pid" "libvirtd (tini)" 60
    # libvirtd is tini's child: it is gone when tini is, but make sure.
    [[ -z $lv ]] || wait_gone "$lv" 10 || die "libvirtd (pid $lv) still runs after its tini exited"
    step 2 "libvirtd" "stopped (tini pid $pid)"
elif pid=$(live_pid "$LIBVIRTD_PIDFILE" libvirtd); then
    stop_pid "$pid" libvirtd 60
    step 2 "libvirtd" "stopped (pid $pid from $LIBVIRTD_PIDFILE, not started under tini)"
else
    step 2 "libvirtd" "already stopped"
fi
rm -f "$LIBVIRTD_TINI_PIDFILE" "$LIBVIRTD_HUGETLBFS_STAMP"

if pid=$(live_pid "$VIRTLOGD_PIDFILE" virtlogd); then
    stop_pid "$pid" virtlogd 30
    step 3 "virtlogd" "stopped (pid $pid)"
else
    step 3 "virtlogd" "already stopped"
fi

hp=$(cat "$HUGEPAGES_2M_SYSFS/nr_hugepages" 2>/dev/null || echo 0)
step 4 "hugepages" "left reserved ($hp x 2 MiB; release with: echo 0 > $HUGEPAGES_2M_SYSFS/nr_hugepages)"
