#!/usr/bin/env bash
# critest back to back on this machine, four ways, with the pin's binaries (scripts/build-k8s.sh):
#
#   1. straight against containerd (scripts/containerd.sh, the pin's containerd 2.x, Debian's runc)
#   2. through vmsandbox (its front and shim, that containerd as its downstream), default handler:
#      every pod goes on to containerd
#   3. through the same vmsandbox with --runtime-handler vmsandbox: every pod is a VM
#   4. shim mode: against containerd's own socket with --runtime-handler vmsandbox, the handler a
#      drop-in maps to vmsandbox's runtime shim (its launcher containerd-shim-vmsandbox-v1): every pod is a VM
#
#   scripts/critest-compare.sh [OUT_DIR]    # default /var/tmp/vmsandbox-critest; K8S_PIN picks the pin
#
# Offline: a local registry holds look-alikes of critest's images (tests/critest_images.py) and
# stands in for gcr.io, registry.k8s.io and k8s.gcr.io on both runtimes. NRI, AppArmor and SELinux
# specs are skipped (neither side is set up for them); CRITEST_SKIP replaces that regex. Pods of all
# three runs share one CNI bridge (CRITEST_BRIDGE, default vmsbr-crt0, 10.238.0.0/24, with portmap).
# OUT_DIR gets each run's log (straight.log, default.log, vmsandbox.log, containerd-shim.log) and summary.txt:
# ginkgo's count line and the failed specs of each. Everything it started is stopped on the way out.
# CRITEST_RUNS picks some of the four runs (default "straight default vmsandbox containerd-shim");
# CRITEST_FOCUS, a regex, runs only the specs it matches (ginkgo's --ginkgo.focus).
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=lib/common.sh
source "$REPO_ROOT/scripts/lib/common.sh"
PY=${VMSANDBOX_VENV:-$REPO_ROOT/.venv}/bin/python
OUT=${1:-/var/tmp/vmsandbox-critest}
BRIDGE=${CRITEST_BRIDGE:-vmsbr-crt0}
SUBNET=${CRITEST_SUBNET:-10.238.0.0/24}
SKIP=${CRITEST_SKIP:-NRI|AppArmor|SELinux}
FOCUS=${CRITEST_FOCUS:-}

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

require_root
BIN=$("$REPO_ROOT/scripts/build-k8s.sh" | tail -n 1)
mkdir -p "$OUT"
WORK=$(mktemp -d /var/tmp/vmsandbox-critest-run.XXXXXX)
chmod 0711 "$WORK" # each sandbox's QEMU runs as a uid of its own below it
SHIM=$WORK/shim
CONTAINERD=$WORK/containerd
REGISTRY_PID="" SHIM_PID=""
FORWARD=$(cat /proc/sys/net/ipv4/ip_forward)

cleanup() {
    local rc=$?
    set +e
    if [[ -n $SHIM_PID ]]; then
        log "removing the shim's sandboxes and stopping it"
        [[ -S $SHIM/cri.sock ]] && "$PY" -m cli.teardown sandboxes "$SHIM/cri.sock" --state-dir "$SHIM/state"
        stop_pid "$SHIM_PID" shim 60
        "$PY" -m cli.teardown domains --state-dir "$SHIM/state"
    fi
    if [[ -f $CONTAINERD/containerd.pid ]]; then
        log "stopping containerd"
        CONTAINERD_BIN_DIR=$WORK/bin bash "$REPO_ROOT/scripts/containerd.sh" down "$CONTAINERD"
    fi
    [[ -z $REGISTRY_PID ]] || stop_pid "$REGISTRY_PID" docker-registry 10
    ip link del dev "$BRIDGE" 2>/dev/null
    echo "$FORWARD" >/proc/sys/net/ipv4/ip_forward
    if grep -qF " $WORK/" /proc/self/mountinfo; then
        warn "something is still mounted under $WORK; leaving it"
    else
        rm -rf --one-file-system "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT

log "critest's look-alike images in a local registry"
images=$("$PY" -m tests.critest_images --start-registry "$WORK/registry")
REGISTRY=$("$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["registry"])' "$images")
REGISTRY_PID=$("$PY" -c 'import json, sys; print(json.loads(sys.argv[1])["registry_pid"])' "$images")
REGISTRIES=$("$PY" -c 'import json, sys; print(json.dumps(json.loads(sys.argv[1])["registries"]))' "$images")

mkdir -p "$WORK/net.d" "$WORK/ipam" "$WORK/netns" "$SHIM"
cat >"$WORK/net.d/10-critest.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "vmsandbox-critest", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$WORK/ipam",
            "ranges": [[{"subnet": "$SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
# containerd finds a runtime type's shim binary on its PATH: the pin's containerd and runc shim, and
# vmsandbox's launchers, one per profile's handler, linked by `vmsandbox profile containerd`, which
# also writes the drop-in mapping each handler to its runtime type (vmsandbox/containerd_config.py)
mkdir -p "$WORK/bin" "$CONTAINERD/conf.d"
ln -sf "$BIN/containerd" "$BIN/containerd-shim-runc-v2" "$WORK/bin/"
"$PY" -m cli.main profile containerd "$REPO_ROOT/deploy/profiles.yaml" --launchers "$WORK/bin" \
    --shim-dir "$SHIM/containerd" >"$CONTAINERD/conf.d/vmsandbox.toml"
log "containerd from $BIN"
CONTAINERD_BIN_DIR=$WORK/bin bash "$REPO_ROOT/scripts/containerd.sh" up "$CONTAINERD" registry.k8s.io/pause:3.10 \
    "$WORK/net.d" "$REGISTRY" >&2

# critest NAME ENDPOINT [ARGS...]: one run, its log in $OUT/NAME.log, its counts and failures in summary
critest() {
    local name=$1 endpoint=$2 t0
    shift 2
    [[ " ${CRITEST_RUNS:-straight default vmsandbox containerd-shim} " == *" $name "* ]] || return 0
    log "critest $name ($*)"
    t0=$(now_ms)
    "$BIN/critest" --runtime-endpoint "$endpoint" --image-endpoint "$endpoint" --ginkgo.skip "$SKIP" \
        ${FOCUS:+--ginkgo.focus "$FOCUS"} --ginkgo.no-color "$@" >"$OUT/$name.log" 2>&1 || true
    {
        echo "== $name ($(secs_since "$t0") s): $*"
        grep -E '^Ran [0-9]+ of [0-9]+ Specs|(SUCCESS|FAIL)! -- ' "$OUT/$name.log" || echo "no ginkgo summary (see $name.log)"
        grep -E '^\s*\[FAIL\]' "$OUT/$name.log" | sed 's/^ */  /' | sort -u || true
    } | tee -a "$OUT/summary.txt" >&2
}

: >"$OUT/summary.txt"
critest straight "unix://$CONTAINERD/containerd.sock"

online=$(</sys/devices/system/cpu/online)
cat >"$SHIM/config.yaml" <<EOF
socket_path: $SHIM/cri.sock
state_dir: $SHIM/state
console_dir: $SHIM/console
profile_files: [$REPO_ROOT/deploy/profiles.yaml]
default_handler: vmsandbox
shared_cpus: "$online"
pod_network: cni
cni_conf_dir: $WORK/net.d
cni_bin_dirs: [/usr/lib/cni]
netns_dir: $WORK/netns
mount_allowlist: [/tmp]
seccomp_profile_root: /tmp
downstream_endpoint: unix://$CONTAINERD/containerd.sock
containerd_address: $CONTAINERD/containerd.sock
containerd_root: $CONTAINERD/root
containerd_shim_dir: $SHIM/containerd
registries: $REGISTRIES
EOF
log "vmsandbox (front and shim) in front of that containerd"
setsid "$PY" -m shim serve --config "$SHIM/config.yaml" </dev/null >"$OUT/shim.log" 2>&1 &
SHIM_PID=$!
for _ in $(seq 300); do
    [[ -S $SHIM/cri.sock ]] && break
    sleep 0.2
done
[[ -S $SHIM/cri.sock ]] || die "the shim did not listen on $SHIM/cri.sock (see $OUT/shim.log)"

critest default "unix://$SHIM/cri.sock"
critest vmsandbox "unix://$SHIM/cri.sock" --runtime-handler vmsandbox
critest containerd-shim "unix://$CONTAINERD/containerd.sock" --runtime-handler vmsandbox
log "logs and summary in $OUT"
