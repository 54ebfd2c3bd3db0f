#!/usr/bin/env bash
# Stop what scripts/setup-host.sh started: libvirtd (through its tini) and virtlogd, found by their
# pidfiles only. Running guests are left alone (QEMU outlives libvirtd; a new libvirtd reconnects).
# Hugepages stay reserved and hugetlbfs stays mounted. Safe to run again.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. "$SCRIPT_DIR/lib/common.sh"
STEP_TOTAL=3

require_root

# libvirtd: ours runs under tini (SIGTERM to tini is forwarded to libvirtd; tini exits after it).
if pid=$(live_pid "$LIBVIRTD_TINI_PIDFILE" tini); then
    lv=$(live_pid "$LIBVIRTD_PIDFILE" libvirtd || true)
    stop_pid "$pid" "libvirtd (tini)" 60
    # libvirtd is tini's child: it is gone when tini is, but make sure.
    [[ -z $lv ]] || wait_gone "$lv" 10 || die "libvirtd (pid $lv) still runs after its tini exited"
    step 1 "libvirtd" "stopped (tini pid $pid)"
elif pid=$(live_pid "$LIBVIRTD_PIDFILE" libvirtd); then
    stop_pid "$pid" libvirtd 60
    step 1 "libvirtd" "stopped (pid $pid from $LIBVIRTD_PIDFILE, not started under tini)"
else
    step 1 "libvirtd" "already stopped"
fi
rm -f "$LIBVIRTD_TINI_PIDFILE" "$LIBVIRTD_HUGETLBFS_STAMP"

if pid=$(live_pid "$VIRTLOGD_PIDFILE" virtlogd); then
    stop_pid "$pid" virtlogd 30
    step 2 "virtlogd" "stopped (pid $pid)"
else
    step 2 "virtlogd" "already stopped"
fi

hp=$(cat "$HUGEPAGES_2M_SYSFS/nr_hugepages" 2>/dev/null || echo 0)
step 3 "hugepages" "left reserved ($hp x 2 MiB; release with: echo 0 > $HUGEPAGES_2M_SYSFS/nr_hugepages)"
