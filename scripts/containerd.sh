#!/usr/bin/env bash
# A containerd of our own beside vmsandbox, the downstream runtime of ordinary pods (no systemd).
#
#   scripts/containerd.sh up DIR [SANDBOX_IMAGE [CNI_CONF_DIR [REGISTRY]]]
#   scripts/containerd.sh down DIR
#   scripts/containerd.sh restart DIR
#
# `up` writes DIR/config.toml and starts containerd (with runc) with its own root, state and socket,
# DIR/containerd.sock, and waits for the CRI plugin to answer. The containerd is Debian's (1.6,
# configuration version 2) unless CONTAINERD_BIN_DIR names a directory holding `containerd` and
# `containerd-shim-runc-v2` (scripts/build-k8s.sh's bin directory: 2.4, configuration version 3),
# which then comes first on containerd's PATH, where it finds its shim; runc is Debian's either way. Its CRI plugin takes
# CNI plugins from /usr/lib/cni (Debian's containernetworking-plugins, the same ones vmsandbox
# uses) and its configuration from CNI_CONF_DIR (default DIR/net.d): give it vmsandbox's
# cni_conf_dir and both runtimes attach pods to the same bridge and share its host-local IPAM
# store, so an ordinary pod and a VM pod reach each other. SANDBOX_IMAGE (default
# registry.k8s.io/pause:3.6) must be pullable offline: point it at a local registry. REGISTRY
# (host:port) is reached over plain HTTP and stands in for docker.io, registry.k8s.io, k8s.gcr.io
# and gcr.io (what tests/critest_images.py serves). `down` stops that
# containerd (by its pid file, checking it is still containerd), the shims and containers it
# started, and unmounts what it mounted under DIR; DIR itself is left for its owner to delete.
# With containerd 2.x and CONTAINERD_NRI_SOCKET set, NRI is on, on that socket only, for external
# plugins (vmsandbox's DRA driver connects there, docs/dra.md), with no plugins of its own
# (DIR/nri/plugins is empty) and a 10 s bound on each plugin call; otherwise NRI is off.
# `restart` stops that containerd only (its shims and containers run on) and starts it again on
# DIR/config.toml as it is now (a drop-in added or removed), in the cgroups of the one it replaces
# (whoever runs `restart`, e.g. an installer pod, may be in a cgroup that goes away).
set -euo pipefail

die() { echo "containerd.sh: $*" >&2; exit 1; }
cmd=${1:-}
dir=${2:-}
[[ -n $cmd && -n $dir ]] || die "usage: $0 up DIR [SANDBOX_IMAGE [CNI_CONF_DIR [REGISTRY]]] | down DIR | restart DIR"
dir=$(realpath -m "$dir")
if [[ -n ${CONTAINERD_BIN_DIR:-} ]]; then
    for b in containerd containerd-shim-runc-v2; do
        [[ -x $CONTAINERD_BIN_DIR/$b ]] || die "CONTAINERD_BIN_DIR: no $CONTAINERD_BIN_DIR/$b"
    done
    export PATH=$CONTAINERD_BIN_DIR:$PATH
fi

# alive PID: running and not a zombie (whoever is pid 1 here may not reap orphans)
alive() { [[ -r /proc/$1/stat ]] && [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]; }

# containerd 1.x (Debian's 1.6): configuration version 2, mirrors inline
config_v2() {
    local image=$1 conf=$2 registry=$3 mirrors="" upstream
    if [[ -n $registry ]]; then
        for upstream in "$registry" docker.io registry.k8s.io k8s.gcr.io gcr.io; do
            mirrors+="
[plugins.\"io.containerd.grpc.v1.cri\".registry.mirrors.\"$upstream\"]
  endpoint = [\"http://$registry\"]"
        done
    fi
    cat <<TOML
version = 2
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[debug]
  address = "$dir/debug.sock"
  level = "info"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$image"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  restrict_oom_score_adj = true
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "$conf"
  max_conf_num = 1$mirrors
TOML
}

# containerd 2.x: configuration version 3 (the CRI plugin split into io.containerd.cri.v1.images and
# io.containerd.cri.v1.runtime; the sandbox image is a pinned image; registry hosts come from
# hosts.toml files under DIR/certs.d; drop-ins from DIR/conf.d/*.toml, e.g. a runtime handler of
# vmsandbox's shim mode). NRI is off (2.x turns it on, on a host-wide socket) unless
# CONTAINERD_NRI_SOCKET names a socket of this containerd's own, and network namespaces are
# mounted under DIR/state rather than the host's /var/run/netns.
config_v3() {
    local image=$1 conf=$2 registry=$3 upstream server nri_off=', "io.containerd.nri.v1.nri"' nri=""
    if [[ -n ${CONTAINERD_NRI_SOCKET:-} ]]; then
        mkdir -p "$dir/nri/plugins" "$dir/nri/conf.d"
        nri_off=""
        nri="
[plugins.'io.containerd.nri.v1.nri']
  disable = false
  disable_connections = false
  socket_path = '$CONTAINERD_NRI_SOCKET'
  plugin_path = '$dir/nri/plugins'
  plugin_config_path = '$dir/nri/conf.d'
  plugin_registration_timeout = '5s'
  plugin_request_timeout = '10s'"
    fi
    rm -rf "$dir/certs.d"
    mkdir -p "$dir/certs.d"
    if [[ -n $registry ]]; then
        for upstream in "$registry" docker.io registry.k8s.io k8s.gcr.io gcr.io; do
            mkdir -p "$dir/certs.d/$upstream"
            case $upstream in
            "$registry") server=http://$registry ;;
            docker.io) server=https://registry-1.docker.io ;;
            *) server=https://$upstream ;;
            esac
            cat >"$dir/certs.d/$upstream/hosts.toml" <<TOML
server = "$server"
[host."http://$registry"]
  capabilities = ["pull", "resolve"]
TOML
        done
    fi
    cat <<TOML
version = 3
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"$nri_off]
imports = ['$dir/conf.d/*.toml'] # its own drop-ins only (2.x reads /etc/containerd/conf.d/*.toml by default)
[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[debug]
  address = "$dir/debug.sock"
  level = "info"
[metrics]
  address = ""
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '$image'
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = '$dir/certs.d'
[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '$conf'
    max_conf_num = 1
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'$nri
TOML
}

up() {
    local image=${1:-registry.k8s.io/pause:3.6} conf=${2:-$dir/net.d} registry=${3:-}
    command -v containerd >/dev/null && command -v runc >/dev/null \
        || die "containerd and runc are not installed (scripts/setup-host.sh installs them)"
    mkdir -p "$dir/root" "$dir/state" "$dir/conf.d" "$conf"
    if [[ -f $dir/containerd.pid ]] && alive "$(cat "$dir/containerd.pid")"; then
        die "a containerd already runs for $dir (pid $(cat "$dir/containerd.pid"))"
    fi
    local major
    major=$(containerd --version | awk '{sub(/^v/, "", $3); split($3, v, "."); print v[1]}')
    [[ $major =~ ^[0-9]+$ ]] || die "cannot tell containerd's version from: $(containerd --version)"
    if ((major >= 2)); then
        config_v3 "$image" "$conf" "$registry" >"$dir/config.toml"
    else
        config_v2 "$image" "$conf" "$registry" >"$dir/config.toml"
    fi
    start
}

# containerd on DIR/config.toml, waited for
start() {
    rm -f "$dir/containerd.sock"
    local booted; booted=$(grep -c "containerd successfully booted" "$dir/containerd.log" 2>/dev/null || true)
    setsid containerd --config "$dir/config.toml" >>"$dir/containerd.log" 2>&1 < /dev/null &
    echo $! > "$dir/containerd.pid"
    for _ in $(seq 100); do
        if [[ -S $dir/containerd.sock ]] && (($(grep -c "containerd successfully booted" "$dir/containerd.log") > ${booted:-0})); then
            echo "containerd $(containerd --version | awk '{print $3}') on unix://$dir/containerd.sock (pid $(cat "$dir/containerd.pid"))"
            return 0
        fi
        alive "$(cat "$dir/containerd.pid")" || { tail -n 20 "$dir/containerd.log" >&2; die "containerd exited"; }
        sleep 0.1
    done
    tail -n 20 "$dir/containerd.log" >&2
    die "containerd did not listen on $dir/containerd.sock within 10 s"
}

# into the cgroups of process PID (cgroup v1 hierarchies and v2's), as far as they are there
join_cgroups() {
    local line ctrl path base
    while IFS= read -r line; do
        ctrl=${line#*:}
        path=${ctrl#*:}
        ctrl=${ctrl%%:*}
        if [[ -z $ctrl ]]; then
            base=/sys/fs/cgroup/unified
            [[ -d $base ]] || base=/sys/fs/cgroup
        else
            base=/sys/fs/cgroup/${ctrl#name=}
        fi
        echo "$BASHPID" >"$base$path/cgroup.procs" 2>/dev/null || true
    done <"/proc/$1/cgroup"
}

# PID TENTHS: SIGTERM, up to TENTHS tenths of a second for it to end, then SIGKILL and wait until it
# is gone (its metadata database's lock with it). It may end at any moment in between: a kill that
# finds no process is no error (a containerd still finishing a call took over 10 s, exited just as
# the SIGKILL came, and the restart stopped there with containerd down).
stop_pid() {
    local pid=$1 tenths=$2
    kill "$pid" 2>/dev/null || true
    for _ in $(seq "$tenths"); do alive "$pid" || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    for _ in $(seq 100); do alive "$pid" || return 0; sleep 0.1; done
    die "containerd (pid $pid) did not end after SIGKILL"
}

restart() {
    local pidfile=$dir/containerd.pid pid
    [[ -f $dir/config.toml ]] || die "no $dir/config.toml (run up first)"
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == containerd ]]; then
        join_cgroups "$pid"
        stop_pid "$pid" 100
    fi
    start
}

down() {
    local pidfile=$dir/containerd.pid
    if [[ -f $pidfile ]]; then
        local pid; pid=$(cat "$pidfile")
        if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == containerd ]]; then
            stop_pid "$pid" 50
        fi
        rm -f "$pidfile"
    fi
    # the shims (and the containers under them) this containerd started outlive it: those whose
    # command line names this directory's socket are ours
    local p
    for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $dir/containerd.sock" || true); do
        [[ $(cat "/proc/$p/comm" 2>/dev/null) == containerd-shim* ]] || continue
        pkill -KILL -P "$p" 2>/dev/null || true
        kill -KILL "$p" 2>/dev/null || true
    done
    # mounts left under DIR (rootfs overlays, shm, netns), deepest first
    awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done
}

case $cmd in
    up) shift 2; up "$@" ;;
    down) down ;;
    restart) restart ;;
    *) die "unknown command $cmd (up, down or restart)" ;;
esac
