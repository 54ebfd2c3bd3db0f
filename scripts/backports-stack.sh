#!/usr/bin/env bash
# Run libvirt 11 and QEMU 10 from Debian bookworm-backports beside the host's libvirt 9.0 and
# QEMU 7.2, without installing them: the packages are downloaded with a private apt state and
# unpacked with `dpkg -x` under $BP_DIR/root; a persistent private mount namespace sees /usr as an
# overlay of that tree over the real /usr and has private /etc/libvirt, /run/libvirt,
# /var/lib/libvirt, /var/log/libvirt and /var/cache/libvirt (tmpfs); its own virtlogd and libvirtd
# (under `tini -s`) run there. Everything started in the namespace (benchmarks included) sees
# qemu:///system as libvirt 11 with QEMU 10; the host's daemons and guests are untouched.
#
#   scripts/backports-stack.sh up          # fetch and unpack (once, cached), start the namespace's daemons
#   scripts/backports-stack.sh run CMD...  # run CMD in the namespace (cwd kept), e.g. a bench
#   scripts/backports-stack.sh down        # destroy its domains, stop its daemons, drop the namespace
#   scripts/backports-stack.sh status
#
# Both libvirts use /dev/hugepages and the machine cgroups; domain names must differ (the shim's
# are per pod). An `up` that fails or is interrupted tears down what it started; `down` is safe to
# run again. The benchmarks clean up their own pods when interrupted; `down` destroys any left.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. "$SCRIPT_DIR/lib/common.sh"

BP_DIR=${VMSANDBOX_BACKPORTS_DIR:-/var/cache/vmsandbox/backports}
ROOT=$BP_DIR/root
NS_DIR=$VMSANDBOX_RUN_DIR/backports
NS=$NS_DIR/mnt # the namespace, bind-mounted so it outlives the commands that use it
LOG_DIR=$VMSANDBOX_LOG_DIR/backports
# in the namespace (its private /run/libvirt): the daemons' pidfiles
BP_LIBVIRTD_PID=/run/libvirt/backports-libvirtd.pid
BP_TINI_PID=/run/libvirt/backports-tini.pid
BP_VIRTLOGD_PID=/run/libvirt/backports-virtlogd.pid
SUITE=bookworm-backports
PACKAGES=(
    qemu-system-x86 qemu-system-common qemu-system-data seabios # seabios: QEMU 10 wants >> 1.16.3
    libvirt0 libvirt-common libvirt-clients libvirt-daemon libvirt-daemon-common libvirt-daemon-log
    libvirt-daemon-driver-qemu
)
PRIVATE_DIRS=(/etc/libvirt /run/libvirt /var/lib/libvirt /var/log/libvirt /var/cache/libvirt)
STEP_TOTAL=4

apt_opts() {
    printf '%s\n' -o "Dir::Etc::sourcelist=$BP_DIR/apt/sources.list" -o Dir::Etc::sourceparts=- \
        -o "Dir::State=$BP_DIR/apt/state" -o "Dir::Cache=$BP_DIR/apt/cache" -o Debug::NoLocking=1
}

# ---- 1. fetch the packages into $BP_DIR/debs (a private apt state: the host's apt is not touched) ---
fetch() {
    if [[ -f $BP_DIR/debs/.done ]]; then
        step 1 "fetch" "already done ($(find "$BP_DIR/debs" -name '*.deb' | wc -l) packages in $BP_DIR/debs)"
        return
    fi
    mkdir -p "$BP_DIR/apt/state/lists/partial" "$BP_DIR/apt/cache/archives/partial" "$BP_DIR/debs"
    printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian %s main\n' \
        "$SUITE" >"$BP_DIR/apt/sources.list"
    local opts
    mapfile -t opts < <(apt_opts)
    apt-get "${opts[@]}" -q update >"$BP_DIR/apt/update.log" 2>&1 || die "apt-get update (private state) failed: $BP_DIR/apt/update.log"
    (cd "$BP_DIR/debs" && apt-get "${opts[@]}" -q -t "$SUITE" download "${PACKAGES[@]}") \
        >"$BP_DIR/apt/download.log" 2>&1 || die "apt-get download failed: $BP_DIR/apt/download.log"
    touch "$BP_DIR/debs/.done"
    step 1 "fetch" "$(find "$BP_DIR/debs" -name '*.deb' | wc -l) packages into $BP_DIR/debs"
}

# ---- 2. unpack them under $ROOT --------------------------------------------------------------------
extract() {
    if [[ -f $ROOT/.done ]]; then
        step 2 "unpack" "already done ($ROOT)"
        return
    fi
    rm -rf "$ROOT"
    mkdir -p "$ROOT"
    local deb
    for deb in "$BP_DIR"/debs/*.deb; do dpkg -x "$deb" "$ROOT"; done
    # Neither may find the host's modules through the overlay: libvirt 11 would load libvirt 9.0's
    # drivers (network, storage, ...) and fail on their symbol versions, QEMU 10 QEMU 7.2's modules
    # (it aborts: "Only modules from the same build can be loaded"). An opaque directory in the
    # upper tree hides the one below it.
    local d
    for d in libvirt qemu; do
        mkdir -p "$ROOT/usr/lib/x86_64-linux-gnu/$d"
        python3 -c 'import os, sys; os.setxattr(sys.argv[1], "trusted.overlay.opaque", b"y")' \
            "$ROOT/usr/lib/x86_64-linux-gnu/$d"
    done
    touch "$ROOT/.done"
    step 2 "unpack" "$(du -sh "$ROOT" | cut -f1) under $ROOT"
}

ns_up() { [[ -e $NS ]] && findmnt -n "$NS" >/dev/null 2>&1; }
in_ns() { nsenter --mount="$NS" -- "$@"; }

# ---- 3. the private mount namespace ----------------------------------------------------------------
namespace() {
    if ns_up; then
        step 3 "namespace" "already done ($NS)"
        return
    fi
    mkdir -p "$NS_DIR" "$LOG_DIR"
    # a namespace file can be bind-mounted only onto a private mount: make $NS_DIR one
    if ! findmnt -n "$NS_DIR" >/dev/null 2>&1; then mount --bind "$NS_DIR" "$NS_DIR"; fi
    mount --make-private "$NS_DIR"
    touch "$NS"
    unshare --mount="$NS" --propagation private true
    in_ns mount -t overlay backports-usr -o "lowerdir=$ROOT/usr:/usr" /usr
    local d
    for d in "${PRIVATE_DIRS[@]}"; do
        mkdir -p "$d"
        in_ns mount -t tmpfs -o mode=0755 "backports${d//\//-}" "$d"
    done
    in_ns cp -a "$ROOT/etc/libvirt/." /etc/libvirt/
    in_ns rm -f /etc/libvirt/qemu.conf # as on the host: libvirt's built-in defaults
    in_ns mkdir -p /var/log/libvirt/qemu /var/lib/libvirt/qemu /var/lib/libvirt/images \
        /var/lib/libvirt/boot /var/cache/libvirt/qemu
    step 3 "namespace" "$NS: /usr = $ROOT/usr over /usr; private ${PRIVATE_DIRS[*]}"
}

# ---- 4. virtlogd and libvirtd in it ------------------------------------------------------------------
daemons() {
    if in_ns bash -c ". '$SCRIPT_DIR/lib/common.sh'; live_pid $BP_LIBVIRTD_PID libvirtd" >/dev/null 2>&1; then
        step 4 "daemons" "already done"
        return
    fi
    local t0
    t0=$(now_ms)
    in_ns env LIBVIRT_LOG_OUTPUTS="3:file:$LOG_DIR/virtlogd.log" virtlogd -d -p "$BP_VIRTLOGD_PID" \
        </dev/null >>"$LOG_DIR/virtlogd.log" 2>&1 9>&-
    in_ns bash -c "LIBVIRT_LOG_OUTPUTS='3:stderr' setsid tini -s -- libvirtd -p $BP_LIBVIRTD_PID \
        </dev/null >>'$LOG_DIR/libvirtd.log' 2>&1 9>&- & echo \$! >$BP_TINI_PID"
    local deadline=$(($(date +%s) + 60))
    until in_ns timeout 20 virsh -q -c "$LIBVIRT_URI" version >/dev/null 2>&1; do
        (($(date +%s) < deadline)) || {
            tail -n 20 "$LOG_DIR/libvirtd.log" >&2
            die "libvirtd 11 did not answer within 60 s (log: $LOG_DIR/libvirtd.log)"
        }
        sleep 0.3
    done
    in_ns timeout 180 virsh -q -c "$LIBVIRT_URI" domcapabilities >/dev/null ||
        die "virsh domcapabilities failed (log: $LOG_DIR/libvirtd.log)"
    step 4 "daemons" "virtlogd and libvirtd started, capabilities cached in $(secs_since "$t0") s: $(in_ns virsh -c "$LIBVIRT_URI" version | grep -E 'library|hypervisor' | tr -s ' ' | paste -sd';')"
}

down() {
    if ! ns_up; then
        rm -f "$NS"
        if findmnt -n "$NS_DIR" >/dev/null 2>&1; then umount "$NS_DIR"; fi
        echo "backports stack: not up"
        return
    fi
    # the namespace's guests (its libvirtd's), then its daemons, by their private pidfiles
    local dom
    while read -r dom; do
        [[ -n $dom ]] || continue
        in_ns timeout 60 virsh -q -c "$LIBVIRT_URI" destroy "$dom" >/dev/null 2>&1 || true
        in_ns timeout 60 virsh -q -c "$LIBVIRT_URI" undefine --nvram "$dom" >/dev/null 2>&1 ||
            in_ns timeout 60 virsh -q -c "$LIBVIRT_URI" undefine "$dom" >/dev/null 2>&1 || true
        echo "destroyed domain $dom"
    done < <(in_ns timeout 30 virsh -q -c "$LIBVIRT_URI" list --all --name 2>/dev/null || true)
    in_ns bash -c "
        . '$SCRIPT_DIR/lib/common.sh'
        if pid=\$(live_pid $BP_TINI_PID tini); then stop_pid \$pid 'libvirtd 11 (tini)' 60
        elif pid=\$(live_pid $BP_LIBVIRTD_PID libvirtd); then stop_pid \$pid 'libvirtd 11' 60; fi
        if pid=\$(live_pid $BP_VIRTLOGD_PID virtlogd); then stop_pid \$pid 'virtlogd 11' 30; fi
    "
    # the namespace's mounts go with it once nothing holds it
    umount "$NS"
    rm -f "$NS"
    # and the bind mount that made $NS_DIR private
    if findmnt -n "$NS_DIR" >/dev/null 2>&1; then umount "$NS_DIR"; fi
    echo "backports stack: down"
}

case ${1:-} in
up)
    require_root
    # failed or interrupted half-way: take down what was started (nothing of the host's); on the
    # script's own stdout and stderr (3, 4), not those of the command the signal interrupted
    exec 3>&1 4>&2
    trap 'trap - ERR INT TERM; { warn "up did not finish: tearing down"; down; } >&3 2>&4; exit 1' ERR INT TERM
    fetch
    extract
    namespace
    daemons
    ;;
run)
    shift
    (($#)) || die "usage: $0 run CMD..."
    ns_up || die "the backports stack is not up (run: $0 up)"
    exec nsenter --mount="$NS" --wd="$PWD" -- "$@"
    ;;
down)
    require_root
    down
    ;;
status)
    if ns_up; then in_ns virsh -c "$LIBVIRT_URI" version; else echo "backports stack: not up"; fi
    ;;
*) die "usage: $0 up|run CMD...|down|status" ;;
esac
