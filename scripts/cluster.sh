#!/usr/bin/env bash
# A one-node Kubernetes cluster on vmsandbox, for node admins and CI:
#
#   scripts/cluster.sh up [KUBE_BIN_DIR] # etcd, kube-apiserver, controller-manager, scheduler, a local
#                                        # registry, containerd, a vmsandbox shim in front of it, a
#                                        # kubelet, kube-proxy and CoreDNS; waits for node Ready
#   scripts/cluster.sh down              # stops all of it by pid and removes what `up` made
#
# KUBE_BIN_DIR (or $KUBE_BIN; default: what scripts/build-k8s.sh builds, pin $K8S_PIN or 1.37) holds
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl. What else it holds
# is used when there: etcd (else the etcd on PATH, else Debian's etcd-server), containerd with
# containerd-shim-runc-v2 (else Debian's containerd), kube-proxy (iptables mode: Services) and
# coredns (cluster DNS, a host process behind the kube-dns Service). Everything lives in $CLUSTER_DIR (default /var/lib/vmsandbox-cluster): certificates,
# etcd's data, the shim's state, the kubelet's root directory, logs, pid files. The kubelet and the
# shim share one private mount namespace (`unshare -m`): the kubelet's volume mounts (tmpfs for
# service-account tokens) must be visible to the runtime that shares them into the guests, and the
# binds that keep the host clean (the kubelet's /var/lib/kubelet, /var/log/pods, /var/log/containers,
# and throwaway files over the sysctls the kubelet writes) stay in there. Run scripts/setup-host.sh
# first (`make cluster` does). No systemd is involved.
#
# The kubelet talks to vmsandbox only. Pods with a vmsandbox RuntimeClass get a VM; every other pod
# (host-network ones included) goes to the cluster's own containerd (scripts/containerd.sh, runc),
# which runs in the same mount namespace and on the same CNI bridge. CLUSTER_DOWNSTREAM=none leaves
# containerd out: vmsandbox is then the only runtime and every pod is a VM. CLUSTER_MODE=shim runs
# vmsandbox's shim mode instead (docs/containerd-shim.md): the kubelet talks to containerd, whose
# drop-in maps each profile's handler to vmsandbox's runtime shim. CLUSTER_MODE=plain is a node with
# plain containerd and no vmsandbox at all (the kubelet on containerd's socket, no drop-in, no
# RuntimeClasses, the node labelled vmsandbox.dev/install=true rather than vmsandbox.dev/runtime=true),
# where the installer of deploy/install/ puts shim mode; containerd's PATH starts with
# $CLUSTER_DIR/bin, the launchers' directory, and `scripts/containerd.sh restart` restarts it. kube-proxy and CoreDNS
# run in the host's namespaces: kube-proxy's chains are what `down` removes with the kubelet's.
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF=$REPO_ROOT/scripts/cluster.sh
# shellcheck source=lib/common.sh
source "$REPO_ROOT/scripts/lib/common.sh"

# ---- settings (environment) ---------------------------------------------------------------------------
CLUSTER_DIR=${CLUSTER_DIR:-/var/lib/vmsandbox-cluster}
PY=${VMSANDBOX_VENV:-$REPO_ROOT/.venv}/bin/python
NODE_NAME=${CLUSTER_NODE_NAME:-$(hostname | tr '[:upper:]' '[:lower:]')}
# the node's address: the source address of the default route unless given
NODE_IP=${CLUSTER_NODE_IP:-}
ETCD_PORT=${CLUSTER_ETCD_PORT:-12379}
ETCD_PEER_PORT=${CLUSTER_ETCD_PEER_PORT:-12380}
APISERVER_PORT=${CLUSTER_APISERVER_PORT:-16443}
CONTROLLER_MANAGER_PORT=${CLUSTER_CONTROLLER_MANAGER_PORT:-11257}
SCHEDULER_PORT=${CLUSTER_SCHEDULER_PORT:-11259}
KUBELET_PORT=${CLUSTER_KUBELET_PORT:-11250}
KUBELET_HEALTHZ_PORT=${CLUSTER_KUBELET_HEALTHZ_PORT:-11248}
REGISTRY_PORT=${CLUSTER_REGISTRY_PORT:-15000}
SERVICE_CIDR=${CLUSTER_SERVICE_CIDR:-10.0.0.0/24}
SERVICE_IP=${CLUSTER_SERVICE_IP:-10.0.0.1} # the `kubernetes` service: first address of SERVICE_CIDR
POD_BRIDGE=${CLUSTER_POD_BRIDGE:-vmsbr-k8s0}
POD_SUBNET=${CLUSTER_POD_SUBNET:-10.236.0.0/24}
# CPUs of the shim's pool that shared pods float over (deploy/profiles.yaml's `vmsandbox` and
# `vmsandbox-medium` handlers are shared); default: every online CPU but the first
SHARED_CPUS=${CLUSTER_SHARED_CPUS:-}
READY_TIMEOUT_S=${CLUSTER_READY_TIMEOUT_S:-240}
DOWNSTREAM=${CLUSTER_DOWNSTREAM:-containerd} # or none
MODE=${CLUSTER_MODE:-proxy} # or shim: the kubelet talks to containerd, vmsandbox is its runtime shim; or plain
# 1: vmsandbox is also the DRA driver vmsandbox.dev (docs/dra.md), with one secondary network,
# DRA_NETWORK on DRA_BRIDGE, and deploy/dra/ (its RBAC and device class) applied; with containerd,
# NRI is on, on $CONTAINERD/nri.sock, where the driver gives ordinary pods their claimed devices
DRA=${CLUSTER_DRA:-0}
DRA_BRIDGE=${CLUSTER_DRA_BRIDGE:-vmsbr-dra0}
DRA_NETWORK=${CLUSTER_DRA_NETWORK:-10.240.0.0/24}
# the guest image the profiles boot: deploy/profiles.yaml's unless given (then a copy of it, naming
# this directory, is the shim's: for a test of a guest image built from this tree)
IMAGE_DIR=${CLUSTER_IMAGE_DIR:-}
PROFILES=$REPO_ROOT/deploy/profiles.yaml
[[ -z $IMAGE_DIR ]] || PROFILES=$CLUSTER_DIR/profiles.yaml
KUBE_PROXY_HEALTHZ_PORT=${CLUSTER_KUBE_PROXY_HEALTHZ_PORT:-11256}
KUBE_PROXY_METRICS_PORT=${CLUSTER_KUBE_PROXY_METRICS_PORT:-11249}
# CoreDNS listens on the node's address at DNS_PORT; pods ask the kube-dns Service at DNS_IP:53,
# which kube-proxy sends there
DNS_IP=${CLUSTER_DNS_IP:-10.0.0.10}
DNS_PORT=${CLUSTER_DNS_PORT:-10053}
DNS_READY_PORT=${CLUSTER_DNS_READY_PORT:-18181}
# how often the kubelet syncs each pod (and so refreshes its ConfigMap and Secret volumes)
SYNC_FREQUENCY=${CLUSTER_SYNC_FREQUENCY:-1m}

PKI=$CLUSTER_DIR/pki
RUN=$CLUSTER_DIR/run     # pid files, and what `up` changed on the host (for `down`)
LOGS=$CLUSTER_DIR/logs
NODE=$CLUSTER_DIR/node   # the kubelet's directories, bound over the host's inside its namespace
SHIM=$CLUSTER_DIR/shim
SOCKET=$SHIM/cri.sock
SHIM_SOCKETS=$SHIM/containerd # shim mode: vmsandbox's ttrpc socket per handler
CONTAINERD=$CLUSTER_DIR/containerd # containerd's config, root, state and socket (scripts/containerd.sh)
case $MODE in
proxy) RUNTIME_SOCKET=$SOCKET ;;  # the kubelet's CRI socket
shim | plain) RUNTIME_SOCKET=$CONTAINERD/containerd.sock ;;
*) die "CLUSTER_MODE: proxy, shim or plain, not $MODE" ;;
esac
[[ $MODE == proxy || $DOWNSTREAM == containerd ]] || die "CLUSTER_MODE=$MODE needs containerd (CLUSTER_DOWNSTREAM=containerd)"
ADMIN_KUBECONFIG=$CLUSTER_DIR/admin.kubeconfig
# the host paths the kubelet uses whatever its flags say, bound to directories of ours in its namespace
NODE_BINDS=("/var/lib/kubelet:$NODE/kubelet" "/var/log/pods:$NODE/pod-logs" "/var/log/containers:$NODE/container-logs")
# sysctls the kubelet sets at start (kernel/panic, panic_on_oops, vm/overcommit_memory): it writes
# throwaway files instead of the host's values
NODE_SYSCTLS=(kernel/panic kernel/panic_on_oops vm/overcommit_memory)

usage() {
    cat <<EOF
usage: $0 up [KUBE_BIN_DIR] | down | restart-shim

  up    start a one-node cluster on vmsandbox (state in \$CLUSTER_DIR, default /var/lib/vmsandbox-cluster);
        the binaries: KUBE_BIN_DIR, else \$KUBE_BIN, else scripts/build-k8s.sh's
  down  stop everything 'up' started (by pid) and remove what it made
  restart-shim  stop the shim (SHIM_STOP_SIGNAL=KILL: as a crash) and start it again in the node's
        mount namespace (with VMSANDBOX_FAULT when set: a test's crash point, shim/faults.py)
EOF
    exit 2
}

# ---- small helpers ------------------------------------------------------------------------------------
log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*"; }

default_node_ip() {
    ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") {print $(i + 1); exit}}'
}

port_in_use() { # PORT -> true when something listens on it (TCP, any address)
    ss -Htln "sport = :$1" | grep -q .
}

# start NAME EXE_BASENAME LOGFILE CMD... : start CMD detached (own session, no terminal, stdio to
# LOGFILE) and record its pid in $RUN/NAME.pid with the executable it must be in $RUN/NAME.exe
start() {
    local name=$1 exe=$2 logfile=$3
    shift 3
    setsid "$@" </dev/null >>"$logfile" 2>&1 &
    echo $! >"$RUN/$name.pid"
    echo "$exe" >"$RUN/$name.exe"
}

running() { # NAME -> pid when NAME's recorded process still runs the recorded executable
    [[ -r $RUN/$1.exe ]] || return 1
    local pid
    pid=$(live_pid "$RUN/$1.pid" "$(<"$RUN/$1.exe")") || return 1
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] || return 1
    printf '%s\n' "$pid"
}

wait_for() { # SECONDS WHAT CMD... : poll CMD every 0.2 s until it succeeds
    local secs=$1 what=$2 deadline
    shift 2
    deadline=$(($(date +%s) + secs))
    until "$@" >/dev/null 2>&1; do
        (($(date +%s) < deadline)) || return 1
        sleep 0.2
    done
}

kubectl() { "$KUBE_BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

# ---- packages -----------------------------------------------------------------------------------------
install_packages() {
    local need=()
    [[ -x $KUBE_BIN/etcd ]] || command -v etcd >/dev/null || need+=(etcd-server)
    command -v openssl >/dev/null || need+=(openssl)
    local tools=(unshare ss iptables docker-registry)
    [[ $DOWNSTREAM == none ]] || tools+=(runc buildah)
    [[ $DOWNSTREAM == none || -n $CONTAINERD_BIN_DIR ]] || tools+=(containerd)
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null || die "$tool not found: run scripts/setup-host.sh first"
    done
    [[ $DOWNSTREAM == containerd || $DOWNSTREAM == none ]] || die "CLUSTER_DOWNSTREAM: containerd or none, got $DOWNSTREAM"
    [[ -x $PY ]] || die "no venv at ${PY%/bin/python}: run scripts/setup-host.sh first"
    ((${#need[@]})) || return 0
    log "installing ${need[*]} from Debian"
    # etcd-server's postinst starts a system-wide etcd through its init script unless policy-rc.d
    # forbids it: this cluster runs its own etcd, so forbid it for the install if nothing does yet
    local policy=/usr/sbin/policy-rc.d made_policy=""
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 0755 "$policy" && made_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >"$LOGS/apt.log" 2>&1 ||
        { apt-get update -q >>"$LOGS/apt.log" 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" \
                >>"$LOGS/apt.log" 2>&1; } || rc=$?
    [[ -z $made_policy ]] || rm -f "$policy"
    ((rc == 0)) || die "apt-get install ${need[*]} failed (see $LOGS/apt.log)"
}

# ---- certificates (openssl, ECDSA P-256) --------------------------------------------------------------
new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# cert NAME SUBJECT EXTENSIONS : $PKI/NAME.{key,crt} signed by the cluster's CA
cert() {
    local name=$1 subject=$2 ext=$3
    new_key "$PKI/$name.key"
    openssl req -new -key "$PKI/$name.key" -subj "$subject" -out "$PKI/$name.csr" 2>/dev/null
    printf '%b\n' "$ext" >"$PKI/$name.ext"
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
        -set_serial "0x$(openssl rand -hex 16)" -days 365 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
    rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

make_pki() {
    mkdir -p -m 0700 "$PKI"
    new_key "$PKI/ca.key"
    openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=vmsandbox-cluster-ca" -days 365 -out "$PKI/ca.crt" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    local client='keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth'
    local server='keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth'
    cert apiserver "/CN=kube-apiserver" "$server\nsubjectAltName=IP:127.0.0.1,IP:$SERVICE_IP,IP:$NODE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
    cert admin "/O=system:masters/CN=admin" "$client"
    cert controller-manager "/CN=system:kube-controller-manager" "$client"
    cert scheduler "/CN=system:kube-scheduler" "$client"
    cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" "$client"
    cert kubelet-serving "/O=system:nodes/CN=system:node:$NODE_NAME" "$server\nsubjectAltName=IP:$NODE_IP,DNS:$NODE_NAME"
    # system:kube-proxy is bound to system:node-proxier by the API server's bootstrap policy;
    # system:coredns gets its role from $CLUSTER_DIR/dns.yaml
    cert kube-proxy "/CN=system:kube-proxy" "$client"
    cert coredns "/CN=system:coredns" "$client"
    # the DRA driver's credential: deploy/dra/rbac.yaml binds this user
    cert vmsandbox-dra "/CN=system:vmsandbox-dra" "$client"
    new_key "$PKI/sa.key"
    openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
    chmod 0600 "$PKI"/*.key
}

kubeconfig() { # FILE USER CERT_NAME
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: vmsandbox
  cluster: {certificate-authority: $PKI/ca.crt, server: "https://127.0.0.1:$APISERVER_PORT"}
users:
- name: $2
  user: {client-certificate: $PKI/$3.crt, client-key: $PKI/$3.key}
contexts:
- name: vmsandbox
  context: {cluster: vmsandbox, user: $2}
current-context: vmsandbox
EOF
    chmod 0600 "$1"
}

# ---- configuration files ------------------------------------------------------------------------------
write_configs() {
    if [[ -n $IMAGE_DIR ]]; then
        [[ -f $IMAGE_DIR/vmlinux && -f $IMAGE_DIR/initramfs.img ]] || die "CLUSTER_IMAGE_DIR: no guest image in $IMAGE_DIR"
        sed "s#image_dir: /var/lib/vmsandbox/images/default#image_dir: $IMAGE_DIR#" "$REPO_ROOT/deploy/profiles.yaml" >"$PROFILES"
    fi
    kubeconfig "$ADMIN_KUBECONFIG" admin admin
    kubeconfig "$PKI/controller-manager.kubeconfig" system:kube-controller-manager controller-manager
    kubeconfig "$PKI/scheduler.kubeconfig" system:kube-scheduler scheduler
    kubeconfig "$PKI/kubelet.kubeconfig" "system:node:$NODE_NAME" kubelet
    kubeconfig "$PKI/kube-proxy.kubeconfig" system:kube-proxy kube-proxy
    kubeconfig "$PKI/coredns.kubeconfig" system:coredns coredns
    kubeconfig "$PKI/vmsandbox-dra.kubeconfig" system:vmsandbox-dra vmsandbox-dra

    mkdir -p "$CLUSTER_DIR/net.d" "$CLUSTER_DIR/netns" "$CLUSTER_DIR/ipam" "$SHIM" "$CLUSTER_DIR/registry"
    cat >"$CLUSTER_DIR/net.d/10-vmsandbox-cluster.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "vmsandbox-cluster", "plugins": [
  {"type": "bridge", "bridge": "$POD_BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$CLUSTER_DIR/ipam",
            "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
    cat >"$SHIM/config.yaml" <<EOF
# the cluster's shim: its own socket, state, CNI network and registry mirror (scripts/cluster.sh)
socket_path: $SOCKET
state_dir: $SHIM/state
console_dir: $SHIM/console
libvirt_uri: qemu:///system
profile_files: [$PROFILES]
default_handler: vmsandbox
shared_cpus: "$SHARED_CPUS"
kubelet_pods_dir: /var/lib/kubelet/pods
pod_network: cni
cni_conf_dir: $CLUSTER_DIR/net.d
cni_bin_dirs: [/usr/lib/cni]
netns_dir: $CLUSTER_DIR/netns
$([[ $DOWNSTREAM == containerd && $MODE == proxy ]] && echo "downstream_endpoint: unix://$CONTAINERD/containerd.sock")
$([[ $MODE == shim ]] && printf 'containerd_address: %s\ncontainerd_root: %s\ncontainerd_shim_dir: %s\n' \
    "$CONTAINERD/containerd.sock" "$CONTAINERD/root" "$SHIM_SOCKETS")
$([[ $DRA == 1 ]] && printf 'dra:\n  kubeconfig: %s\n  node_name: %s\n  networks:\n    - {name: net1, kind: bridge, interface: %s, subnet: "%s"}\n' \
    "$PKI/vmsandbox-dra.kubeconfig" "$NODE_NAME" "$DRA_BRIDGE" "$DRA_NETWORK")
$([[ $DRA == 1 && $DOWNSTREAM == containerd ]] && printf '  nri_socket: %s\n' "$CONTAINERD/nri.sock")
registries:
  # the cluster's registry (127.0.0.1:$REGISTRY_PORT) mirrors docker.io: push busybox there and
  # \`image: busybox\` pulls it offline; images may also name 127.0.0.1:$REGISTRY_PORT/... directly
  - prefix: docker.io
    mirrors: [{location: "127.0.0.1:$REGISTRY_PORT", insecure: true}]
EOF
    cat >"$CLUSTER_DIR/registry/config.yml" <<EOF
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $CLUSTER_DIR/registry/data}, delete: {enabled: true}}
http: {addr: "127.0.0.1:$REGISTRY_PORT"}
EOF
    mkdir -p "$NODE/kubelet" "$NODE/pod-logs" "$NODE/container-logs" "$NODE/sysctl" "$NODE/volume-plugins"
    cat >"$NODE/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$RUNTIME_SOCKET
imageServiceEndpoint: unix://$RUNTIME_SOCKET
# a 1.34+ kubelet takes the driver from the runtime's RuntimeConfig (vmsandbox answers cgroupfs, or
# passes the downstream's answer on); older ones use this
cgroupDriver: cgroupfs
# this host is cgroup v1 (hybrid); a 1.35+ kubelet refuses it unless told (older ones ignore the key)
failCgroupV1: false
clusterDomain: cluster.local
$([[ -z $DNS ]] || echo "clusterDNS: [$DNS_IP]")
syncFrequency: $SYNC_FREQUENCY
configMapAndSecretChangeDetectionStrategy: Watch
# the kubelet leaves iptables alone: kube-proxy makes its own chains
makeIPTablesUtilChains: false
# a development node: evict only when the disk is really full
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, imagefs.available: 2%}
imageGCHighThresholdPercent: 98
imageGCLowThresholdPercent: 95
maxPods: 16
# node allocatable, enforced on /kubepods (--enforce-node-allocatable=pods): what a 2-CPU node keeps
# back for the kubelet, the runtimes and the system; every pod, VM pods' QEMU included, is under it
kubeReserved: {cpu: 200m, memory: 512Mi, pid: "1000"}
systemReserved: {cpu: 200m, memory: 512Mi, pid: "1000"}
EOF
}

start_shim() {
    rm -f "$SOCKET" # a killed shim leaves its socket behind
    start shim "$(basename "$(readlink -f "$PY")")" "$LOGS/shim.log" \
        "$PY" -m shim serve --config "$SHIM/config.yaml"
    wait_for 60 "the shim's socket" test -S "$SOCKET" ||
        die "the shim did not listen on $SOCKET within 60 s (see $LOGS/shim.log)"
}

# `restart-shim`: the running cluster's shim stopped (SIGTERM; SIGKILL with SHIM_STOP_SIGNAL=KILL, as
# a crash) and started again in the kubelet's mount namespace, as `up` started it; the environment's
# VMSANDBOX_FAULT, if any, reaches the new shim (shim/faults.py: a test's crash point). A shim that
# is not running (it died) is only started.
restart_shim() {
    require_root
    local pid kubelet
    if pid=$(running shim); then
        if [[ ${SHIM_STOP_SIGNAL:-TERM} == KILL ]]; then
            kill -KILL "$pid" 2>/dev/null || true
            wait_gone "$pid" 20 || die "the shim (pid $pid) survived SIGKILL"
        else
            stop_pid "$pid" shim 60
        fi
    fi
    kubelet=$(running kubelet) || die "the kubelet is not running: no node to restart the shim in"
    nsenter --mount="/proc/$kubelet/ns/mnt" -- "$SELF" _shim
}

# A sandbox image for containerd, offline: busybox-static sleeping (what a pause container does),
# built by buildah with storage of its own under $CLUSTER_DIR (vfs: nothing mounted).
push_pause_image() {
    local b=(buildah --root "$CLUSTER_DIR/buildah/storage" --runroot "$CLUSTER_DIR/buildah/run" --storage-driver vfs)
    local ctx=$CLUSTER_DIR/buildah/ctx container
    mkdir -p "$ctx/bin"
    cp /bin/busybox "$ctx/bin/busybox"
    ln -sf busybox "$ctx/bin/sleep"
    container=$("${b[@]}" from scratch)
    "${b[@]}" copy "$container" "$ctx" /
    "${b[@]}" config --cmd '["/bin/sleep", "2147483647"]' "$container"
    "${b[@]}" commit --quiet --format docker "$container" vmsandbox-pause
    "${b[@]}" rm "$container"
    "${b[@]}" push --quiet --tls-verify=false --format v2s2 vmsandbox-pause \
        "docker://127.0.0.1:$REGISTRY_PORT/vmsandbox/pause:1"
}

# ---- the node: the shim and the kubelet in one private mount namespace ----------------------------------
# Runs inside `unshare -m` (called by `up` as "$SELF _node"): binds, then both daemons, then returns.
node_namespace() {
    for bind in "${NODE_BINDS[@]}"; do
        mount --bind "${bind#*:}" "${bind%%:*}"
    done
    for s in "${NODE_SYSCTLS[@]}"; do
        local f=$NODE/sysctl/${s//\//.}
        cat "/proc/sys/$s" >"$f"
        mount --bind "$f" "/proc/sys/$s"
    done
    if [[ $MODE == shim ]]; then
        shim_mode_drop_in
    elif [[ $MODE == plain ]]; then
        containerd_bin_dir
    fi
    if [[ $DOWNSTREAM == containerd ]]; then
        # its sandbox image comes from the cluster's registry, which also stands in for docker.io
        # with the DRA driver, NRI on, on a socket of its own: the driver gives ordinary pods their
        # claimed devices from there (docs/dra.md)
        CONTAINERD_NRI_SOCKET=$([[ $DRA == 1 ]] && echo "$CONTAINERD/nri.sock") \
            CONTAINERD_BIN_DIR=$CONTAINERD_BIN_DIR bash "$REPO_ROOT/scripts/containerd.sh" up "$CONTAINERD" "127.0.0.1:$REGISTRY_PORT/vmsandbox/pause:1" \
            "$CLUSTER_DIR/net.d" "127.0.0.1:$REGISTRY_PORT" >>"$LOGS/containerd-up.log" 2>&1 ||
            die "containerd did not start (see $LOGS/containerd-up.log, $CONTAINERD/containerd.log)"
    fi
    local labels=vmsandbox.dev/runtime=true
    if [[ $MODE == plain ]]; then
        labels=vmsandbox.dev/install=true # where the installer's DaemonSet runs
    else
        start_shim
    fi
    start kubelet kubelet "$LOGS/kubelet.log" \
        "$KUBE_BIN/kubelet" --config="$NODE/kubelet-config.yaml" --kubeconfig="$PKI/kubelet.kubeconfig" \
        --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --node-labels="$labels" \
        --volume-plugin-dir="$NODE/volume-plugins" \
        --cgroups-per-qos=true --enforce-node-allocatable=pods --fail-swap-on=false
}

# shim mode: containerd finds vmsandbox's launchers on its PATH (a directory of links beside its own
# binaries: one per profile's handler, with the file naming the shim directory), and a drop-in maps
# every profile's handler to its runtime type (`vmsandbox profile containerd` makes both)
shim_mode_drop_in() {
    containerd_bin_dir
    mkdir -p "$CONTAINERD/conf.d"
    "$PY" -m cli.main profile containerd "$PROFILES" --launchers "$CLUSTER_DIR/bin" --shim-dir "$SHIM_SOCKETS" \
        >"$CONTAINERD/conf.d/vmsandbox.toml"
}

# containerd's binaries linked into $CLUSTER_DIR/bin, which comes first on its PATH (where it finds
# its shims: runc's, and vmsandbox's launchers once linked there)
containerd_bin_dir() {
    local bin=$CLUSTER_DIR/bin from
    mkdir -p "$bin"
    for from in containerd containerd-shim-runc-v2; do
        ln -sf "$(if [[ -n $CONTAINERD_BIN_DIR ]]; then echo "$CONTAINERD_BIN_DIR/$from"; else command -v "$from"; fi)" "$bin/$from"
    done
    CONTAINERD_BIN_DIR=$bin
}

# ---- up -----------------------------------------------------------------------------------------------
ETCD="" PROXY="" DNS=""
# `_node` (a process of its own) finds it in the environment `up` exports
CONTAINERD_BIN_DIR=${CONTAINERD_BIN_DIR:-}
# what KUBE_BIN holds besides the five it must: each is used when there
choose_binaries() {
    ETCD=etcd CONTAINERD_BIN_DIR=""
    [[ ! -x $KUBE_BIN/etcd ]] || ETCD=$KUBE_BIN/etcd
    if [[ $DOWNSTREAM == containerd && -x $KUBE_BIN/containerd && -x $KUBE_BIN/containerd-shim-runc-v2 ]]; then
        CONTAINERD_BIN_DIR=$KUBE_BIN
    fi
    if [[ -x $KUBE_BIN/kube-proxy ]]; then
        PROXY=1
    else
        warn "no $KUBE_BIN/kube-proxy: Services will not reach pods"
    fi
    if [[ -x $KUBE_BIN/coredns && -n $PROXY ]]; then
        DNS=1
    else
        warn "no $KUBE_BIN/coredns (or no kube-proxy): no cluster DNS; pods get the host's resolv.conf"
    fi
}

# kube-proxy in iptables mode, in the host's network namespace. It leaves the host's sysctls alone:
# no conntrack limits or timeouts (0), no oom_score_adj change (this host refuses lowering it), no
# route_localnet (localhostNodePorts false). masqueradeAll: a pod reaching a Service whose endpoint
# is on the same bridge gets its answer back through the host's NAT even where bridged traffic
# skips iptables (br_netfilter off).
write_proxy_config() {
    cat >"$CLUSTER_DIR/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $PKI/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $POD_SUBNET
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
oomScoreAdj: 0
iptables: {masqueradeAll: true, localhostNodePorts: false}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
nodePortAddresses: ["$NODE_IP/32"]
EOF
}

# CoreDNS answers for cluster.local from the API server (the `kubernetes` plugin, with a client
# certificate of its own) and forwards the rest to the host's resolvers. The kube-dns Service has
# no selector: its one endpoint is this process, on the node's address.
write_dns_config() {
    cat >"$CLUSTER_DIR/Corefile" <<EOF
.:$DNS_PORT {
    bind $NODE_IP
    ready 127.0.0.1:$DNS_READY_PORT
    errors
    log
    cache 30
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $PKI/coredns.kubeconfig vmsandbox
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    forward . /etc/resolv.conf
}
EOF
    cat >"$CLUSTER_DIR/dns.yaml" <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "vmsandbox:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "vmsandbox:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "vmsandbox:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $DNS_IP
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: $DNS_PORT}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: $DNS_PORT}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-node
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: vmsandbox-cluster}
addressType: IPv4
ports:
- {name: dns, port: $DNS_PORT, protocol: UDP}
- {name: dns-tcp, port: $DNS_PORT, protocol: TCP}
endpoints:
- addresses: [$NODE_IP]
  conditions: {ready: true}
  nodeName: $NODE_NAME
EOF
}

start_proxy_and_dns() {
    if [[ -n $PROXY ]]; then
        log "kube-proxy (iptables mode)"
        write_proxy_config
        start kube-proxy kube-proxy "$LOGS/kube-proxy.log" "$KUBE_BIN/kube-proxy" --config="$CLUSTER_DIR/kube-proxy.yaml"
        wait_for 60 kube-proxy curl -sf "http://127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT/healthz" ||
            die "kube-proxy was not healthy within 60 s (see $LOGS/kube-proxy.log)"
    fi
    if [[ -n $DNS ]]; then
        log "CoreDNS on $NODE_IP:$DNS_PORT, the kube-dns Service $DNS_IP:53"
        write_dns_config
        kubectl apply -f "$CLUSTER_DIR/dns.yaml" >/dev/null
        start coredns coredns "$LOGS/coredns.log" "$KUBE_BIN/coredns" -conf "$CLUSTER_DIR/Corefile"
        wait_for 60 CoreDNS curl -sf "http://127.0.0.1:$DNS_READY_PORT/ready" ||
            die "CoreDNS was not ready within 60 s (see $LOGS/coredns.log)"
    fi
}

node_ready() {
    [[ $(kubectl get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}') == True ]]
}

up() {
    local t0
    t0=$(now_ms)
    require_root
    if [[ -z ${KUBE_BIN:-} ]]; then
        log "Kubernetes, etcd, containerd and CoreDNS from scripts/build-k8s.sh (pin ${K8S_PIN:-1.37}; builds what is missing)"
        KUBE_BIN=$("$REPO_ROOT/scripts/build-k8s.sh" | tail -n 1) || die "scripts/build-k8s.sh failed"
    fi
    KUBE_BIN=$(cd "$KUBE_BIN" && pwd) || die "KUBE_BIN: no directory $KUBE_BIN"
    for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl; do
        [[ -x $KUBE_BIN/$b ]] || die "$KUBE_BIN/$b is missing or not executable"
    done
    choose_binaries
    if [[ -d $RUN ]]; then
        for name in "$RUN"/*.pid; do
            [[ -e $name ]] || continue
            if running "$(basename "$name" .pid)" >/dev/null; then
                die "a cluster already runs from $CLUSTER_DIR ($(basename "$name" .pid) is up): run '$0 down' first"
            fi
        done
        die "$CLUSTER_DIR holds what a stopped cluster left: run '$0 down' first"
    fi
    [[ -n $NODE_IP ]] || NODE_IP=$(default_node_ip)
    [[ -n $NODE_IP && $NODE_IP != 127.* ]] ||
        die "no non-loopback node address (set CLUSTER_NODE_IP): kube-apiserver advertises it"
    if [[ -z $SHARED_CPUS ]]; then
        local online first last
        online=$(</sys/devices/system/cpu/online)
        first=${online%%[-,]*}
        last=${online##*[-,]}
        if ((first + 1 < last)); then
            SHARED_CPUS=$((first + 1))-$last
        elif ((first + 1 == last)); then
            SHARED_CPUS=$last
        else
            SHARED_CPUS=$online # one CPU: shared pods only
        fi
    fi
    for p in "$ETCD_PORT" "$ETCD_PEER_PORT" "$APISERVER_PORT" "$CONTROLLER_MANAGER_PORT" "$SCHEDULER_PORT" \
        "$KUBELET_PORT" "$KUBELET_HEALTHZ_PORT" "$REGISTRY_PORT" "$KUBE_PROXY_HEALTHZ_PORT" "$KUBE_PROXY_METRICS_PORT" \
        "$DNS_PORT" "$DNS_READY_PORT"; do
        port_in_use "$p" && die "port $p is in use (set the CLUSTER_*_PORT variables to free ones)"
    done
    ip link show dev "$POD_BRIDGE" >/dev/null 2>&1 && die "the bridge $POD_BRIDGE exists already (set CLUSTER_POD_BRIDGE)"

    mkdir -p "$CLUSTER_DIR" "$LOGS"
    chmod 0711 "$CLUSTER_DIR" # passable: each sandbox's QEMU runs as a uid of its own below it (keys stay in 0700 pki)
    install_packages
    mkdir -p "$RUN"
    trap up_exit EXIT
    # what `down` puts back or removes on the host
    cat /proc/sys/net/ipv4/ip_forward >"$RUN/ip_forward"
    iptables_chains >"$RUN/iptables-chains"
    : >"$RUN/made-dirs"
    for bind in "${NODE_BINDS[@]}"; do
        local target=${bind%%:*}
        if [[ ! -d $target ]]; then
            mkdir -p "$target"
            echo "$target" >>"$RUN/made-dirs"
        fi
    done
    {
        echo "KUBE_BIN=$KUBE_BIN"
        echo "CONTAINERD_BIN_DIR=$CONTAINERD_BIN_DIR"
        echo "NODE_NAME=$NODE_NAME"
        echo "NODE_IP=$NODE_IP"
        echo "POD_BRIDGE=$POD_BRIDGE"
    } >"$RUN/settings"
    if [[ $DRA == 1 ]] && ! ip link show dev "$DRA_BRIDGE" >/dev/null 2>&1; then
        # the DRA network's bridge: claimed NICs of VM pods are taps on it; the host holds its first
        # address, so the host (and a runc pod routed through it) reaches them
        local dra_host
        dra_host=$("$PY" -c 'import ipaddress, sys; n = ipaddress.ip_network(sys.argv[1]); print(f"{next(n.hosts())}/{n.prefixlen}")' "$DRA_NETWORK")
        ip link add name "$DRA_BRIDGE" type bridge || die "cannot make the DRA bridge $DRA_BRIDGE"
        echo "DRA_BRIDGE=$DRA_BRIDGE" >>"$RUN/settings"
        ip addr add "$dra_host" dev "$DRA_BRIDGE" && ip link set dev "$DRA_BRIDGE" up ||
            die "cannot bring the DRA bridge $DRA_BRIDGE up at $dra_host"
    fi

    log "certificates (openssl) and configuration in $CLUSTER_DIR"
    make_pki
    write_configs
    # deploy/profiles.yaml is written for larger nodes: say which RuntimeClasses this one cannot serve
    # (the shim refuses their pods at RunPodSandbox, naming the shortfall)
    if ! "$PY" -m shim profile validate --config "$SHIM/config.yaml" "$PROFILES" \
        >"$LOGS/profiles.txt" 2>&1; then
        warn "profiles this node cannot serve (their RuntimeClasses' pods will be refused):"
        grep -vE ': [0-9]+ profiles? ' "$LOGS/profiles.txt" | sed 's/^/  /' >&2 || true
    fi

    log "etcd on 127.0.0.1:$ETCD_PORT"
    start etcd etcd "$LOGS/etcd.log" "$ETCD" --name vmsandbox-cluster --data-dir "$CLUSTER_DIR/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "vmsandbox-cluster=http://127.0.0.1:$ETCD_PEER_PORT"
    log "registry on 127.0.0.1:$REGISTRY_PORT (docker.io mirror for the shim)"
    start registry docker-registry "$LOGS/registry.log" docker-registry serve "$CLUSTER_DIR/registry/config.yml"
    wait_for 30 etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health" || die "etcd did not answer (see $LOGS/etcd.log)"
    if [[ $DOWNSTREAM == containerd ]]; then
        wait_for 30 registry curl -sf "http://127.0.0.1:$REGISTRY_PORT/v2/" || die "the registry did not answer"
        log "containerd's sandbox image: 127.0.0.1:$REGISTRY_PORT/vmsandbox/pause:1 (busybox sleeping, buildah)"
        push_pause_image >>"$LOGS/pause-image.log" 2>&1 || die "could not build the pause image (see $LOGS/pause-image.log)"
    fi

    log "kube-apiserver on $NODE_IP:$APISERVER_PORT"
    start apiserver kube-apiserver "$LOGS/kube-apiserver.log" "$KUBE_BIN/kube-apiserver" \
        --etcd-servers="http://127.0.0.1:$ETCD_PORT" --etcd-prefix=/vmsandbox-cluster \
        --advertise-address="$NODE_IP" --bind-address=0.0.0.0 --secure-port="$APISERVER_PORT" \
        --cert-dir="$PKI" --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
        --client-ca-file="$PKI/ca.crt" \
        --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types=InternalIP \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local \
        --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
        --service-cluster-ip-range="$SERVICE_CIDR" --authorization-mode=Node,RBAC \
        --enable-admission-plugins=NodeRestriction --allow-privileged=true --profiling=false
    wait_for 90 kube-apiserver kubectl get --raw /readyz ||
        die "kube-apiserver was not ready within 90 s (see $LOGS/kube-apiserver.log)"

    log "kube-controller-manager and kube-scheduler"
    start controller-manager kube-controller-manager "$LOGS/kube-controller-manager.log" \
        "$KUBE_BIN/kube-controller-manager" --kubeconfig="$PKI/controller-manager.kubeconfig" \
        --authentication-kubeconfig="$PKI/controller-manager.kubeconfig" \
        --authorization-kubeconfig="$PKI/controller-manager.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port="$CONTROLLER_MANAGER_PORT" \
        --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
        --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
        --use-service-account-credentials=true --service-cluster-ip-range="$SERVICE_CIDR" \
        --leader-elect=false --profiling=false
    start scheduler kube-scheduler "$LOGS/kube-scheduler.log" "$KUBE_BIN/kube-scheduler" \
        --kubeconfig="$PKI/scheduler.kubeconfig" --authentication-kubeconfig="$PKI/scheduler.kubeconfig" \
        --authorization-kubeconfig="$PKI/scheduler.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port="$SCHEDULER_PORT" --leader-elect=false --profiling=false

    if [[ $DRA == 1 ]]; then # before the shim starts: its first ResourceSlice sync needs its RBAC
        kubectl apply -f "$REPO_ROOT/deploy/dra/rbac.yaml" -f "$REPO_ROOT/deploy/dra/deviceclass.yaml" >/dev/null
    fi
    log "${DOWNSTREAM/none/no downstream}, vmsandbox shim and kubelet (node $NODE_NAME) in a private mount namespace"
    export CLUSTER_DIR KUBE_BIN NODE_NAME NODE_IP PY DOWNSTREAM REGISTRY_PORT CONTAINERD_BIN_DIR
    unshare -m --propagation private -- "$SELF" _node
    wait_for "$READY_TIMEOUT_S" "node Ready" node_ready ||
        die "node $NODE_NAME was not Ready within ${READY_TIMEOUT_S} s (see $LOGS/kubelet.log, $LOGS/shim.log)"
    local ready_s
    ready_s=$(secs_since "$t0")
    log "node $NODE_NAME Ready ${ready_s} s after start"
    [[ $MODE == plain ]] || kubectl apply -f "$REPO_ROOT/deploy/runtimeclass.yaml" >/dev/null
    start_proxy_and_dns
    # pods are refused until the controller-manager has made their namespace's default service account
    wait_for 60 "the default service account" kubectl -n default get serviceaccount default ||
        die "no default service account within 60 s (see $LOGS/kube-controller-manager.log)"
    UP_DONE=1
    echo "$ready_s" >"$RUN/ready-seconds"
    cat <<EOF

The cluster is up (node Ready after ${ready_s} s; everything ready after $(secs_since "$t0") s).
  export KUBECONFIG=$ADMIN_KUBECONFIG
  $KUBE_BIN/kubectl get nodes -o wide
  $KUBE_BIN/kubectl get runtimeclass         # vmsandbox, vmsandbox-medium, ... (deploy/runtimeclass.yaml)
Pods choose a VM profile with spec.runtimeClassName (default handler: vmsandbox). Images: push to the
cluster's registry 127.0.0.1:$REGISTRY_PORT (it mirrors docker.io for the shim) or name any registry.
  $PY -m shim ls --state-dir $SHIM/state     # the VMs
Logs: $LOGS. Stop it all: $0 down
EOF
}

UP_DONE=""
up_exit() { # `up` ended: on failure, show why and undo what it did
    local status=$?
    [[ -z $UP_DONE ]] || return 0
    echo "--- the cluster did not come up; the last lines of each log:" >&2
    for f in "$LOGS"/*.log; do
        [[ -s $f ]] || continue
        echo "--- $f" >&2
        tail -n 8 "$f" >&2
    done
    if [[ -z ${CLUSTER_KEEP_ON_FAILURE:-} ]]; then
        echo "--- stopping what was started (CLUSTER_KEEP_ON_FAILURE=1 keeps it)" >&2
        down || true
    fi
    exit "$status"
}

# ---- down ---------------------------------------------------------------------------------------------
iptables_chains() { # "family table chain" for every chain of the filter, nat and mangle tables
    for family in iptables ip6tables; do
        for table in filter nat mangle; do
            "$family" -w 5 -t "$table" -S 2>/dev/null | awk -v f="$family" -v t="$table" '$1 == "-N" {print f, t, $2}'
        done
    done
}

# The chains named KUBE-* that appeared since `up` (the kubelet's and kube-proxy's) go, in one
# iptables-restore per table: the rules of older chains that jump to them, then their own rules,
# then the chains themselves (chains that jump to each other can only go in that order).
remove_new_chains() {
    local new family table chains rc=0
    new=$(iptables_chains | grep -vxF -f "$RUN/iptables-chains" | awk '$3 ~ /^KUBE-/' || true)
    [[ -n $new ]] || return 0
    while read -r family table; do
        chains=$(awk -v f="$family" -v t="$table" '$1 == f && $2 == t {print $3}' <<<"$new")
        log "removing the $family $table chains ${chains//$'\n'/ }"
        {
            echo "*$table"
            "$family" -w 5 -t "$table" -S | awk -v list="$chains" '
                BEGIN { n = split(list, c, " "); for (i = 1; i <= n; i++) mine[c[i]] = 1 }
                $1 == "-A" && !($2 in mine) { for (i = 3; i < NF; i++) if (($i == "-j" || $i == "-g") && ($(i + 1) in mine)) { sub(/^-A/, "-D"); print; next } }'
            for c in $chains; do echo "-F $c"; done
            for c in $chains; do echo "-X $c"; done
            echo COMMIT
        } | "$family-restore" -w 5 --noflush || rc=1
    done < <(awk '{print $1, $2}' <<<"$new" | sort -u)
    return "$rc"
}

stop_named() { # NAME SECONDS
    local pid
    if pid=$(running "$1"); then
        log "stopping $1 (pid $pid)"
        stop_pid "$pid" "$1" "$2"
    fi
    rm -f "$RUN/$1.pid" "$RUN/$1.exe"
}

DOWN_PROBLEMS=()
problem() { # MESSAGE: `down` goes on, and says at the end that it did not finish cleanly
    warn "$*"
    DOWN_PROBLEMS+=("$*")
}

# Every sandbox the cluster's shim still holds (the kubelet is stopped first, so none is made
# meanwhile): StopPodSandbox + RemovePodSandbox over its socket, which destroys the VM and
# releases its CPUs, hugepages, network namespace and CNI allocation. The shim's own (VM) sandboxes
# go first and a failure (a downstream that is down) never stops the rest; each is one line.
remove_sandboxes() {
    [[ -S $SOCKET ]] || return 0
    "$PY" -m cli.teardown sandboxes "$SOCKET" --state-dir "$SHIM/state"
}

# The shim is stopped: any domain of its state that libvirt still has (the shim could not remove it,
# or was not there to) is destroyed by its metadata, before the state that names it goes.
remove_state_domains() {
    [[ -f $SHIM/state/state.db ]] || return 0
    "$PY" -m cli.teardown domains --state-dir "$SHIM/state"
}

# The kubelet's pod cgroups (--cgroups-per-qos: /kubepods/{burstable,besteffort}/pod<uid> in each v1
# hierarchy), deepest first, once its pods and their VMs are gone: a cgroup directory goes only empty.
remove_pod_cgroups() {
    local root ok=0
    for root in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
        [[ -d $root ]] || continue
        find "$root" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [[ ! -d $root ]] || { warn "$root is still there"; ok=1; }
    done
    return $ok
}

down() {
    require_root
    [[ -d $CLUSTER_DIR ]] || { log "no cluster in $CLUSTER_DIR"; return 0; }
    [[ $CLUSTER_DIR != / ]] || die "CLUSTER_DIR is /"
    if [[ -r $RUN/settings ]]; then
        local KUBE_BIN NODE_NAME NODE_IP POD_BRIDGE CONTAINERD_BIN_DIR DRA_BRIDGE="" # the values `up` used
        # shellcheck disable=SC1091
        source "$RUN/settings"
    fi
    # each step in a subshell: one that fails (even by `die`) is reported and the next one runs
    (stop_named kubelet 30) || problem "the kubelet did not stop"
    if ! running shim >/dev/null && [[ -f $SHIM/state/state.db ]] &&
        [[ $("$PY" -m shim ls --state-dir "$SHIM/state" --format json 2>/dev/null) != "[]" ]]; then
        # the shim died and left sandboxes (their VMs run on in libvirtd): start it again, on its own,
        # so that it releases them as it always does
        log "the shim is not running but holds sandboxes: starting it again to remove them"
        export CLUSTER_DIR PY
        unshare -m --propagation private -- "$SELF" _shim || warn "the shim did not start again (see $LOGS/shim.log)"
    fi
    if running shim >/dev/null; then
        remove_sandboxes || problem "not every sandbox was removed through the shim (above; see $LOGS/shim.log)"
    fi
    (stop_named shim 60) || problem "the shim did not stop"
    local vms_gone=1
    remove_state_domains || { vms_gone=""; problem "VMs of the shim's state may still run (above)"; }
    if [[ -f $CONTAINERD/containerd.pid ]]; then
        log "stopping containerd"
        CONTAINERD_BIN_DIR=${CONTAINERD_BIN_DIR:-} bash "$REPO_ROOT/scripts/containerd.sh" down "$CONTAINERD" || problem "containerd did not stop cleanly"
    fi
    remove_pod_cgroups || problem "the kubelet's /kubepods cgroups were not all removed (a process still in one?)"
    local name secs
    for name in coredns:10 kube-proxy:20 scheduler:20 controller-manager:20 apiserver:30 etcd:20 registry:10; do
        secs=${name##*:}
        name=${name%:*}
        (stop_named "$name" "$secs") || problem "$name did not stop"
    done
    if [[ -n ${POD_BRIDGE:-} ]] && ip link show dev "$POD_BRIDGE" >/dev/null 2>&1; then
        log "removing the bridge $POD_BRIDGE"
        ip link del dev "$POD_BRIDGE" || problem "the bridge $POD_BRIDGE was not removed"
    fi
    if [[ -n ${DRA_BRIDGE:-} ]] && ip link show dev "$DRA_BRIDGE" >/dev/null 2>&1; then
        log "removing the DRA bridge $DRA_BRIDGE"
        ip link del dev "$DRA_BRIDGE" || problem "the bridge $DRA_BRIDGE was not removed"
    fi
    if [[ -r $RUN/iptables-chains ]]; then
        remove_new_chains || problem "not every KUBE-* chain was removed (see above)"
    fi
    if [[ -r $RUN/ip_forward ]]; then
        cat "$RUN/ip_forward" >/proc/sys/net/ipv4/ip_forward || problem "ip_forward not put back"
    fi
    if [[ -r $RUN/made-dirs ]]; then
        while read -r d; do
            [[ -n $d ]] && rmdir "$d" 2>/dev/null || true
        done <"$RUN/made-dirs"
    fi
    # the private mount namespace went away with its last process; nothing of ours is mounted here
    if grep -qF " $CLUSTER_DIR/" /proc/self/mountinfo; then
        problem "something is still mounted under $CLUSTER_DIR; not removing it"
    elif [[ -z $vms_gone ]]; then
        # the state names the VMs that may still run: `down` again removes them once libvirt answers
        problem "$CLUSTER_DIR kept: it is how '$0 down' finds those VMs again"
    else
        rm -rf --one-file-system "$CLUSTER_DIR"
        log "cluster down; $CLUSTER_DIR removed"
    fi
    if ((${#DOWN_PROBLEMS[@]})); then
        printf 'cluster down with %d problem(s):\n' "${#DOWN_PROBLEMS[@]}" >&2
        printf '  %s\n' "${DOWN_PROBLEMS[@]}" >&2
        return 1
    fi
}

case ${1:-} in
up)
    [[ -z ${2:-} ]] || KUBE_BIN=$2
    up
    ;;
down) down ;;
restart-shim) restart_shim ;;
_node) node_namespace ;;
_shim) start_shim ;;
*) usage ;;
esac
