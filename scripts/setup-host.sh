#!/usr/bin/env bash
# Prepare this host for vmsandbox: packages, libvirt's user and directories, 2 MiB hugepages and
# hugetlbfs, virtlogd, libvirtd (under `tini -s`, no systemd needed), the Python venv and the guest
# image. Safe to run again: every step checks first and says "already done" when there is nothing to do.
#
# Run as root:  scripts/setup-host.sh
# Environment:
#   VMSANDBOX_HUGEPAGES_2M  2 MiB pages to keep reserved (default 1024 = 2 GiB)
#   VMSANDBOX_IMAGE_DIR     guest image output (default /var/lib/vmsandbox/images/default)
#   VMSANDBOX_VENV          Python venv (default <repo>/.venv)
#   PYTHON                  interpreter that creates the venv (default python3)
# Undo the daemons with scripts/stop-host.sh (hugepages stay reserved).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. "$SCRIPT_DIR/lib/common.sh"

HUGEPAGES_2M=${VMSANDBOX_HUGEPAGES_2M:-1024}
IMAGE_DIR=${VMSANDBOX_IMAGE_DIR:-/var/lib/vmsandbox/images/default}
VENV=${VMSANDBOX_VENV:-$REPO_ROOT/.venv}
PYTHON=${PYTHON:-python3}
LIBVIRTD_START_TIMEOUT=60

# Debian 12 package names. qemu-system-x86/qemu-utils: the VMM; libvirt-daemon(+driver-qemu):
# libvirtd/virtlogd without libvirt-daemon-system (which brings init scripts, polkit and networks
# we do not use); libvirt-dev, pkg-config, gcc, libc6-dev, python3-dev: libvirt-python builds from
# source; python3-venv: venvs for Debian's python3; busybox-static, xz-utils, cpio, kmod, golang-go
# (builds the guest agent): the guest image recipe (the CRI front is built with the machine's Go
# 1.26 and its own go.mod, scripts/build-front.sh); tini: child subreaper for libvirtd. skopeo: the
# image store's registry transport; docker-registry: the local registry the image tests and
# benchmark push to (never left running by the package: see below); apache2-utils: htpasswd for the
# registry-auth tests. containernetworking-plugins (in /usr/lib/cni: bridge, host-local, portmap,
# ...), iproute2, iptables (portmap's rules, and the nat rule in a shim-mode pod's namespace that
# forwards its loopback into the guest: shim/loopback_forwards.py) and util-linux (unshare/nsenter):
# the pod network and its tests. e2fsprogs (mkfs.ext4): each sandbox's directory is an ext4 image of its own.
APT_PACKAGES=(
    qemu-system-x86 qemu-utils
    libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients libvirt-dev pkg-config
    gcc libc6-dev python3-dev python3-venv
    busybox-static xz-utils cpio kmod golang-go tini
    skopeo umoci docker-registry apache2-utils buildah erofs-utils
    containernetworking-plugins iproute2 iptables util-linux e2fsprogs
    containerd runc
)

T_START=$(now_ms)
umask 022 # libvirt-qemu must read what we create (image dir, logs dir)
require_root
[[ $HUGEPAGES_2M =~ ^[0-9]+$ ]] || die "VMSANDBOX_HUGEPAGES_2M must be a number of pages, got '$HUGEPAGES_2M'"

mkdir -p "$VMSANDBOX_RUN_DIR" "$VMSANDBOX_LOG_DIR"
# One setup at a time (tests may run this while a developer does). fd 9 is closed for every daemon.
exec 9>"$VMSANDBOX_RUN_DIR/setup-host.lock"
flock -w 900 9 || die "another setup-host.sh holds $VMSANDBOX_RUN_DIR/setup-host.lock"

# tail_log FILE -> its last lines, indented, for error messages.
tail_log() { tail -n "${2:-20}" "$1" 2>/dev/null | sed 's/^/    /' >&2 || true; }

# rotate LOG when it grew past 10 MiB (daemons append to it).
rotate_log() {
    local f=$1
    if [[ -f $f ]] && (($(stat -c %s "$f") > 10485760)); then mv -f "$f" "$f.1"; fi
}

# ---- 1. packages ---------------------------------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
    if [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true) != "install ok installed" ]]; then
        missing+=("$p")
    fi
done
if ((${#missing[@]} == 0)); then
    step 1 "apt packages" "already done (${#APT_PACKAGES[@]} packages installed)"
else
    step 1 "apt packages" "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt_log=$VMSANDBOX_LOG_DIR/apt.log
    t0=$SECONDS
    # Packages must not start daemons (docker-registry's would listen on :5000): a policy-rc.d that
    # denies every start, only while we install and only when the host has none of its own.
    own_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    apt_ok=1
    { apt-get update -q && apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"; } \
        </dev/null >"$apt_log" 2>&1 || apt_ok=0
    ((own_policy)) && rm -f /usr/sbin/policy-rc.d
    if ((!apt_ok)); then
        tail_log "$apt_log"
        die "apt-get failed (full log: $apt_log)"
    fi
    step 1 "apt packages" "installed ${#missing[@]} in $((SECONDS - t0)) s"
fi

# ---- 2. libvirt's user, group and directories ------------------------------------------------------
# libvirt-daemon-system would create these; we do not install it (no systemd here).
changed=()
if ! getent group libvirt-qemu >/dev/null; then
    groupadd --system libvirt-qemu
    changed+=("group libvirt-qemu")
fi
if ! getent passwd libvirt-qemu >/dev/null; then
    useradd --system --gid libvirt-qemu --home-dir /var/lib/libvirt --no-create-home \
        --shell /usr/sbin/nologin --comment "Libvirt Qemu" libvirt-qemu
    changed+=("user libvirt-qemu")
fi
# /dev/kvm must be root:kvm 0660 with libvirt-qemu in group kvm, even where guests run TCG. libvirt
# probes QEMU's capabilities as root (so KVM looks available) but trusts its capabilities cache only
# while libvirt-qemu itself can open /dev/kvm; when it cannot, every lookup throws the cache away and
# probes QEMU again (~10 s per domain definition). Hosts without udev leave /dev/kvm root:root 0600
# and have no kvm group. The group and membership come first, the device last: the ctime change of
# chgrp/chmod is what makes a running libvirtd check again.
if [[ -c /dev/kvm ]]; then
    if ! getent group kvm >/dev/null; then
        groupadd --system kvm
        changed+=("group kvm")
    fi
    if ! id -nG libvirt-qemu | tr ' ' '\n' | grep -qx kvm; then
        usermod -a -G kvm libvirt-qemu
        changed+=("libvirt-qemu in group kvm")
    fi
    kvm_mode=$(stat -c %a /dev/kvm)
    if [[ $(stat -c %G /dev/kvm) != kvm ]] || (((8#$kvm_mode & 8#060) != 8#060)) ||
        [[ ${changed[*]} == *"in group kvm"* ]]; then
        # chmod even when the mode is right: a membership change alone leaves the ctime unchanged
        chgrp kvm /dev/kvm
        chmod g+rw /dev/kvm
        changed+=("/dev/kvm $(stat -c '%U:%G %a' /dev/kvm) (was $kvm_mode)")
    fi
fi
for d in /var/log/libvirt/qemu /var/lib/libvirt/qemu /var/lib/libvirt/images /var/lib/libvirt/boot \
    /var/cache/libvirt/qemu /run/libvirt /var/lib/vmsandbox/images; do
    if [[ ! -d $d ]]; then
        mkdir -p "$d"
        changed+=("$d")
    fi
done
if ((${#changed[@]} == 0)); then
    step 2 "libvirt user and dirs" "already done"
else
    step 2 "libvirt user and dirs" "created ${changed[*]}"
fi

# ---- 3. hugepages and hugetlbfs (before libvirtd: it looks for hugetlbfs mounts only at start) ------
[[ -w $HUGEPAGES_2M_SYSFS/nr_hugepages ]] ||
    die "this kernel has no 2 MiB hugepages ($HUGEPAGES_2M_SYSFS/nr_hugepages not writable)"
have=$(<"$HUGEPAGES_2M_SYSFS/nr_hugepages")
if ((have >= HUGEPAGES_2M)); then
    step 3 "hugepages" "already done ($have x 2 MiB reserved, want $HUGEPAGES_2M)"
else
    echo "$HUGEPAGES_2M" >"$HUGEPAGES_2M_SYSFS/nr_hugepages" || true
    got=$(<"$HUGEPAGES_2M_SYSFS/nr_hugepages")
    if ((got < HUGEPAGES_2M)); then
        # Memory may just be fragmented: compact once and ask again.
        echo 1 >/proc/sys/vm/compact_memory 2>/dev/null || true
        echo "$HUGEPAGES_2M" >"$HUGEPAGES_2M_SYSFS/nr_hugepages" || true
        got=$(<"$HUGEPAGES_2M_SYSFS/nr_hugepages")
    fi
    ((got >= HUGEPAGES_2M)) ||
        die "the kernel reserved only $got of $HUGEPAGES_2M 2 MiB hugepages (HugePages_Total); free memory or set VMSANDBOX_HUGEPAGES_2M lower"
    step 3 "hugepages" "reserved $got x 2 MiB (was $have)"
fi
hugetlbfs_mounted_now=0
if hugetlbfs_mount_id >/dev/null; then
    step 3 "hugetlbfs" "already done (mounted at $HUGETLBFS_MOUNT)"
else
    mkdir -p "$HUGETLBFS_MOUNT"
    mount -t hugetlbfs -o pagesize=2M hugetlbfs "$HUGETLBFS_MOUNT"
    hugetlbfs_mounted_now=1
    step 3 "hugetlbfs" "mounted at $HUGETLBFS_MOUNT"
fi
hugetlbfs_id=$(hugetlbfs_mount_id)

# ---- 4. virtlogd (QEMU's stdout/stderr and console logs go through it: stdio_handler = "logd") -----
if pid=$(live_pid "$VIRTLOGD_PIDFILE" virtlogd); then
    step 4 "virtlogd" "already done (pid $pid)"
else
    rotate_log "$VIRTLOGD_LOG"
    LIBVIRT_LOG_OUTPUTS="3:file:$VIRTLOGD_LOG" virtlogd -d -p "$VIRTLOGD_PIDFILE" \
        </dev/null >>"$VIRTLOGD_LOG" 2>&1 9>&- ||
        {
            tail_log "$VIRTLOGD_LOG"
            die "virtlogd -d failed (log: $VIRTLOGD_LOG)"
        }
    # -d returns once the daemon is initialised; its pidfile is there by then.
    pid=$(live_pid "$VIRTLOGD_PIDFILE" virtlogd) || die "virtlogd did not write a live $VIRTLOGD_PIDFILE"
    step 4 "virtlogd" "started (pid $pid)"
fi

# ---- 5. libvirtd under `tini -s` (a child subreaper: PID 1 here reaps orphans slowly) --------------
virsh_ok() { timeout 20 virsh -q -c "$LIBVIRT_URI" version >/dev/null 2>&1; }

stop_libvirtd_for_restart() {
    local pid
    if pid=$(live_pid "$LIBVIRTD_TINI_PIDFILE" tini); then
        stop_pid "$pid" "libvirtd (tini)" 60
    elif pid=$(live_pid "$LIBVIRTD_PIDFILE" libvirtd); then
        stop_pid "$pid" libvirtd 60
    fi
    rm -f "$LIBVIRTD_TINI_PIDFILE" "$LIBVIRTD_HUGETLBFS_STAMP"
}

restart_reason=""
if pid=$(live_pid "$LIBVIRTD_TINI_PIDFILE" tini); then
    # Mount ids are recycled, so the stamp alone cannot see an unmount+mount: the flag can.
    started_with=$(cat "$LIBVIRTD_HUGETLBFS_STAMP" 2>/dev/null || true)
    if ((hugetlbfs_mounted_now)) || [[ $started_with != "$hugetlbfs_id" ]]; then
        restart_reason="hugetlbfs was not mounted (or was remounted) when it started"
    fi
elif pid=$(live_pid "$LIBVIRTD_PIDFILE" libvirtd); then
    # Started by someone else (not under our tini). Keep it unless it cannot know hugetlbfs.
    if ((hugetlbfs_mounted_now)); then
        restart_reason="hugetlbfs was mounted after it started"
    else
        warn "libvirtd pid $pid was not started by this script (not under tini -s); keeping it"
    fi
else
    pid=""
fi
if [[ -n $restart_reason ]]; then
    step 5 "libvirtd" "restarting pid $pid: $restart_reason"
    stop_libvirtd_for_restart
    pid=""
fi

if [[ -n $pid ]]; then
    virsh_ok || die "libvirtd (pid $pid) runs but $LIBVIRT_URI does not answer; see $LIBVIRTD_LOG or run scripts/stop-host.sh and retry"
    step 5 "libvirtd" "already done (pid $pid, $LIBVIRT_URI answers)"
else
    rotate_log "$LIBVIRTD_LOG"
    printf '==== %s setup-host.sh starts libvirtd\n' "$(date -Is)" >>"$LIBVIRTD_LOG"
    t0=$(now_ms)
    # setsid: own session, so no terminal or job-control signal of the caller reaches it.
    # stdio to the log: a caller capturing our output must not wait on the daemon's copy of the pipe.
    LIBVIRT_LOG_OUTPUTS="3:stderr" setsid tini -s -- libvirtd -p "$LIBVIRTD_PIDFILE" \
        </dev/null >>"$LIBVIRTD_LOG" 2>&1 9>&- &
    tini_pid=$!
    echo "$tini_pid" >"$LIBVIRTD_TINI_PIDFILE"
    echo "$hugetlbfs_id" >"$LIBVIRTD_HUGETLBFS_STAMP"
    deadline=$(($(date +%s) + LIBVIRTD_START_TIMEOUT))
    until virsh_ok; do
        if ! kill -0 "$tini_pid" 2>/dev/null; then
            tail_log "$LIBVIRTD_LOG"
            die "libvirtd exited during start-up (log: $LIBVIRTD_LOG)"
        fi
        if (($(date +%s) >= deadline)); then
            tail_log "$LIBVIRTD_LOG"
            die "libvirtd did not answer on $LIBVIRT_URI within ${LIBVIRTD_START_TIMEOUT}s (log: $LIBVIRTD_LOG)"
        fi
        sleep 0.2
    done
    # The first use probes QEMU's capabilities (~8 s); do it now, not in the first test or pod.
    timeout 120 virsh -q -c "$LIBVIRT_URI" domcapabilities >/dev/null ||
        die "virsh domcapabilities failed (log: $LIBVIRTD_LOG)"
    step 5 "libvirtd" "started (tini pid $tini_pid) and capabilities cached in $(secs_since "$t0") s"
fi

# ---- 6. Python venv with the project installed editable (libvirt-python builds against libvirt-dev) -
venv_py=$VENV/bin/python
venv_stamp=$VENV/.vmsandbox-setup-host.stamp
venv_log=$VMSANDBOX_LOG_DIR/pip.log
if [[ ! -x $venv_py ]] || ! "$venv_py" -c 'import sys' 2>/dev/null; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
        die "$PYTHON is missing or older than 3.11 (set PYTHON=/path/to/python3.11+)"
    "$PYTHON" -m venv --clear "$VENV" || die "$PYTHON -m venv $VENV failed (Debian's python3 needs python3-venv)"
    venv_created=1
else
    venv_created=0
fi
want_stamp="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1) $("$venv_py" -c 'import sys; print(sys.version.split()[0])') $REPO_ROOT"
have_stamp=$(cat "$venv_stamp" 2>/dev/null || true)
# The stamp says what was installed; the import check catches a venv someone changed by hand.
if [[ $have_stamp == "$want_stamp" ]] &&
    "$venv_py" -c 'import libvirt, importlib.metadata as m; m.distribution("vmsandbox")' 2>/dev/null; then
    step 6 "python venv" "already done ($VENV, pyproject.toml unchanged)"
else
    t0=$(now_ms)
    rm -f "$venv_stamp"
    if ! (cd "$REPO_ROOT" && "$venv_py" -m pip install --disable-pip-version-check --no-input \
        -e '.[dev]') </dev/null >"$venv_log" 2>&1 9>&-; then
        tail_log "$venv_log"
        die "pip install -e '.[dev]' failed (full log: $venv_log)"
    fi
    echo "$want_stamp" >"$venv_stamp"
    what=$([[ $venv_created == 1 ]] && echo "created $VENV and installed" || echo "installed")
    step 6 "python venv" "$what -e '.[dev]' in $(secs_since "$t0") s"
fi

# ---- 7. guest image (images/build.sh is idempotent on its own) -------------------------------------
build_sh=$REPO_ROOT/images/build.sh
image_log=$VMSANDBOX_LOG_DIR/image-build.log
if [[ ! -f $build_sh ]]; then
    step 7 "guest image" "WARNING: $build_sh not found; skipped (rerun this script once it exists)"
else
    mkdir -p "$IMAGE_DIR"
    marker=$VMSANDBOX_RUN_DIR/image-build.marker
    touch "$marker"
    t0=$(now_ms)
    if ! bash "$build_sh" "$IMAGE_DIR" </dev/null >"$image_log" 2>&1 9>&-; then
        tail_log "$image_log"
        die "images/build.sh $IMAGE_DIR failed (full log: $image_log)"
    fi
    # build.sh rewrites manifest.json exactly when it builds (libvirt's chown of the image files at each
    # guest start changes their ctime, so the files themselves cannot tell)
    if [[ $IMAGE_DIR/manifest.json -nt $marker ]]; then
        step 7 "guest image" "built in $IMAGE_DIR in $(secs_since "$t0") s"
    else
        step 7 "guest image" "already done ($IMAGE_DIR up to date)"
    fi
fi

# The agent's Go tests (tests/images/test_agent_go.py runs them with GOPROXY=off) check its answers
# against the protocol's schema with a validator images/agent/go.mod pins for the tests alone (the
# agent itself is built from the standard library): fetch it into the Go module cache.
agent_mod_log=$VMSANDBOX_LOG_DIR/agent-modules.log
if (cd "$REPO_ROOT/images/agent" && GOPROXY=off go mod download) </dev/null >/dev/null 2>&1 9>&-; then
    step 7 "agent test modules" "already done (in the Go module cache)"
elif (cd "$REPO_ROOT/images/agent" && go mod download) </dev/null >"$agent_mod_log" 2>&1 9>&-; then
    step 7 "agent test modules" "fetched into the Go module cache"
else
    tail_log "$agent_mod_log"
    die "go mod download in images/agent failed (full log: $agent_mod_log)"
fi

# ---- 8. the CRI front (scripts/build-front.sh is idempotent on its own) ----------------------------
front_log=$VMSANDBOX_LOG_DIR/front-build.log
t0=$(now_ms)
if ! front_said=$(bash "$REPO_ROOT/scripts/build-front.sh" </dev/null 2>"$front_log" 9>&-); then
    tail_log "$front_log"
    die "scripts/build-front.sh failed (full log: $front_log)"
fi
if [[ $front_said == "up to date" ]]; then
    step 8 "cri front" "already done (/usr/local/libexec/vmsandbox/vmsandbox-front up to date)"
else
    step 8 "cri front" "built /usr/local/libexec/vmsandbox/vmsandbox-front in $(secs_since "$t0") s"
fi

# ---- 9. summary ----------------------------------------------------------------------------------------
ver=$(virsh -c "$LIBVIRT_URI" version --daemon 2>/dev/null || true)
daemon_ver=$(sed -n 's/^Running against daemon: *//p' <<<"$ver")
hv_ver=$(sed -n 's/^Running hypervisor: *//p' <<<"$ver")
hp_total=$(<"$HUGEPAGES_2M_SYSFS/nr_hugepages")
hp_free=$(<"$HUGEPAGES_2M_SYSFS/free_hugepages")
if grep -qwE 'vmx|svm' /proc/cpuinfo; then accel="kvm"; else accel="tcg (no vmx/svm flags)"; fi
manifest=$(find "$IMAGE_DIR" -maxdepth 1 -name 'manifest*' -print -quit 2>/dev/null || true)
step 9 "summary" "libvirt ${daemon_ver:-?} ($hv_ver) on $LIBVIRT_URI; accel $accel"
step 9 "summary" "hugepages 2 MiB total $hp_total free $hp_free at $HUGETLBFS_MOUNT; image manifest ${manifest:-none yet in $IMAGE_DIR}"
echo "host ready in $(secs_since "$T_START") s"
