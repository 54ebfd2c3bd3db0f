#!/usr/bin/env bash
# Start a vmsandbox shim on its own unix socket, walk one pod through it with real CRI calls
# (python -m cli.demo), then stop the shim. Run scripts/setup-host.sh first (make demo does).
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${VMSANDBOX_VENV:-$REPO_ROOT/.venv}/bin/python
WORK=$(mktemp -d /run/vmsandbox-demo.XXXXXX)
chmod 0711 "$WORK" # passable: each sandbox's QEMU, as its own uid, reaches its directory in the state below
SOCKET=$WORK/vmsandbox.sock
SHIM_PID=""
REGISTRY_PID=""
# the demo pod's network: a CNI bridge network of its own (Debian's plugins), put away afterwards
DEMO_BRIDGE=vmsbr-demo0
IP_FORWARD=$(cat /proc/sys/net/ipv4/ip_forward)

cleanup() {
    if [[ -n $SHIM_PID ]] && kill -0 "$SHIM_PID" 2>/dev/null; then
        kill -TERM "$SHIM_PID"
        wait "$SHIM_PID" 2>/dev/null || true
    fi
    if [[ -n $REGISTRY_PID ]]; then
        kill -TERM "$REGISTRY_PID" 2>/dev/null || true
    fi
    ip link del dev "$DEMO_BRIDGE" 2>/dev/null || true
    echo "$IP_FORWARD" >/proc/sys/net/ipv4/ip_forward
    rm -rf "$WORK"
}
trap cleanup EXIT

cd "$REPO_ROOT"
echo "starting a local registry with a busybox image (built from the host's busybox-static)"
image_json=$("$PY" -m scripts.demo_image "$WORK/registry")
IMAGE=$("$PY" -c 'import json,sys; print(json.load(sys.stdin)["image"])' <<<"$image_json")
REGISTRY_PID=$("$PY" -c 'import json,sys; print(json.load(sys.stdin)["registry_pid"])' <<<"$image_json")
echo "starting the shim on $SOCKET (log: $WORK/shim.log)"
mkdir -p "$WORK/net.d"
cat >"$WORK/net.d/10-demo.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "vmsandbox-demo", "plugins": [
  {"type": "bridge", "bridge": "$DEMO_BRIDGE", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "dataDir": "$WORK/ipam",
            "ranges": [[{"subnet": "10.232.0.0/24", "gateway": "10.232.0.1"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
cat >"$WORK/config.yaml" <<EOF
pod_network: cni
cni_conf_dir: $WORK/net.d
cni_bin_dirs: [/usr/lib/cni]
netns_dir: $WORK/netns
EOF
"$PY" -m shim serve --config "$WORK/config.yaml" --socket "$SOCKET" --state-dir "$WORK/state" \
    --console-dir "$WORK/console" \
    >"$WORK/shim.log" 2>&1 &
SHIM_PID=$!
for _ in $(seq 1 600); do
    [[ -S $SOCKET ]] && break
    if ! kill -0 "$SHIM_PID" 2>/dev/null; then
        echo "the shim exited before listening:" >&2
        cat "$WORK/shim.log" >&2
        exit 1
    fi
    sleep 0.1
done
[[ -S $SOCKET ]] || { echo "the shim did not listen within 60 s" >&2; cat "$WORK/shim.log" >&2; exit 1; }
status=0
"$PY" -m cli.demo --socket "$SOCKET" --image "$IMAGE" || status=$?
if ((status != 0)); then
    echo "--- shim log ---" >&2
    tail -n 30 "$WORK/shim.log" >&2
fi
exit "$status"
