# shellcheck shell=bash disable=SC2034  # constants here are used by the scripts that source this
# Shared helpers for scripts/setup-host.sh and scripts/stop-host.sh.
# Sourced, never executed. Callers run with `set -euo pipefail`.

# ---- paths (overridable from the environment where it makes sense) --------------------------------
VMSANDBOX_RUN_DIR=${VMSANDBOX_RUN_DIR:-/run/vmsandbox}
VMSANDBOX_LOG_DIR=${VMSANDBOX_LOG_DIR:-/var/log/vmsandbox}

# libvirtd runs in the foreground under `tini -s`; this pidfile holds tini's pid (ours).
LIBVIRTD_TINI_PIDFILE=$VMSANDBOX_RUN_DIR/libvirtd-tini.pid
# libvirtd's own pidfile (it writes one even in the foreground when privileged).
LIBVIRTD_PIDFILE=/run/libvirtd.pid
# mount id (from /proc/self/mountinfo) of the hugetlbfs that was mounted when we started libvirtd.
LIBVIRTD_HUGETLBFS_STAMP=$VMSANDBOX_RUN_DIR/libvirtd-hugetlbfs.mountid
LIBVIRTD_LOG=$VMSANDBOX_LOG_DIR/libvirtd.log
# virtlogd -d writes its own pidfile; we name it explicitly.
VIRTLOGD_PIDFILE=/run/virtlogd.pid
VIRTLOGD_LOG=$VMSANDBOX_LOG_DIR/virtlogd.log

LIBVIRT_URI=qemu:///system
HUGETLBFS_MOUNT=/dev/hugepages
HUGEPAGES_2M_SYSFS=/sys/kernel/mm/hugepages/hugepages-2048kB

# ---- output ----------------------------------------------------------------------------------------
# One short line per step: "[n/N] name: message".
STEP_TOTAL=${STEP_TOTAL:-9}
step() { # step N NAME MESSAGE...
    local n=$1 name=$2
    shift 2
    printf '[%s/%s] %s: %s\n' "$n" "$STEP_TOTAL" "$name" "$*"
}
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die() {
    printf 'ERROR: %s\n' "$*" >&2
    exit 1
}

now_ms() { echo $(($(date +%s%N) / 1000000)); }
# secs_since T0_MS -> elapsed seconds with one decimal.
secs_since() {
    local d=$(($(now_ms) - $1))
    printf '%d.%d' $((d / 1000)) $((d % 1000 / 100))
}

require_root() {
    [[ ${EUID:-$(id -u)} -eq 0 ]] || die "$(basename "$0") must run as root (it installs packages, reserves hugepages and starts libvirtd)"
}

# ---- processes, by pidfile only ----------------------------------------------------------------------
# pidfile_pid FILE -> prints the pid in FILE if it names a live process, else returns 1.
pidfile_pid() {
    local file=$1 pid
    [[ -r $file ]] || return 1
    pid=$(<"$file") 2>/dev/null || return 1 # daemons write it without a trailing newline
    pid=${pid//[[:space:]]/}
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    printf '%s\n' "$pid"
}

# pid_is PID EXE_BASENAME -> true when PID runs that executable (guards against a recycled pid in a
# stale pidfile; the pid itself always comes from a pidfile, never from a search by name).
pid_is() {
    local pid=$1 want=$2 exe
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
    exe=${exe% (deleted)}
    [[ ${exe##*/} == "$want" ]]
}

# live_pid FILE EXE_BASENAME -> pid from FILE when it is alive and is EXE_BASENAME.
live_pid() {
    local pid
    pid=$(pidfile_pid "$1") || return 1
    pid_is "$pid" "$2" || return 1
    printf '%s\n' "$pid"
}

# wait_gone PID SECONDS -> true once PID has exited (polls every 0.1 s).
wait_gone() {
    local pid=$1 deadline=$(($(date +%s) + $2))
    while kill -0 "$pid" 2>/dev/null; do
        # a zombie that is not our child counts as gone once its parent reaps it; check state
        if [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]]; then return 0; fi
        (($(date +%s) < deadline)) || return 1
        sleep 0.1
    done
}

# stop_pid PID NAME SECONDS -> SIGTERM, wait, then SIGKILL as a last resort.
stop_pid() {
    local pid=$1 name=$2 secs=$3
    kill -TERM "$pid" 2>/dev/null || return 0
    if ! wait_gone "$pid" "$secs"; then
        warn "$name (pid $pid) did not exit ${secs}s after SIGTERM; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        wait_gone "$pid" 10 || die "$name (pid $pid) survived SIGKILL"
    fi
}

# ---- hugetlbfs --------------------------------------------------------------------------------------
# hugetlbfs_mount_id -> mount id of the hugetlbfs mounted at $HUGETLBFS_MOUNT (topmost), or fail.
hugetlbfs_mount_id() {
    awk -v mp="$HUGETLBFS_MOUNT" '
        { for (i = 7; i <= NF; i++) if ($i == "-") break
          if ($5 == mp && $(i + 1) == "hugetlbfs") id = $1 }
        END { if (id == "") exit 1; print id }' /proc/self/mountinfo
}
