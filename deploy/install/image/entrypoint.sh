#!/bin/sh
# The vmsandbox installer's entrypoint (busybox sh, in the privileged pod of
# deploy/install/daemonset.yaml; the host's / at /host). Install: the payload (wheels, guest image,
# default profiles) and the daemon's config.yaml copied under $VMSANDBOX_PREFIX, a venv made there
# with the host's Python from the wheels, `vmsandbox node install` (containerd's drop-in, its
# imports, the launchers' links, containerd restarted), the daemon started on the host, the node
# labelled vmsandbox.dev/runtime=true. Then it waits; SIGTERM (the DaemonSet deleted) undoes it all:
# the label, the daemon's VM pods and the daemon, `vmsandbox node uninstall`, the prefix.
# Host commands run in the host's mount namespace (nsenter; pid 1's, or that of the pid in
# $VMSANDBOX_HOST_PID_FILE) with a plain environment; the service account's token and CA reach the
# one that labels the node through its environment only.
set -eu

HOST=/host
PREFIX=${VMSANDBOX_PREFIX:-/opt/vmsandbox}
RESTART=${VMSANDBOX_RESTART:-systemctl restart containerd}
PYTHON=${VMSANDBOX_HOST_PYTHON:-python3}
READY=/tmp/vmsandbox-installed
LOG=$PREFIX/node.log
SA=/var/run/secrets/kubernetes.io/serviceaccount
HOST_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DAEMON=""

say() { echo "vmsandbox-installer: $*" >&2; }

host_pid() {
    if [ -n "${VMSANDBOX_HOST_PID_FILE:-}" ]; then cat "$HOST$VMSANDBOX_HOST_PID_FILE"; else echo 1; fi
}

# COMMAND...: run on the host, with a plain environment
on_host() {
    nsenter -t "$(host_pid)" -m -u -i -n -- /usr/bin/env -i PATH="$HOST_PATH" HOME=/root "$@"
}

# COMMAND...: on the host as on_host does, in a session of its own and out of this container's
# cgroups, in those of the host process whose namespaces it enters: the install and the uninstall run
# to their end even when the container is ended half way (run in the container's session, an
# uninstall was seen killed while containerd restarted), and what they start is never the container's
# Its output goes to $PREFIX/node.log on the host (kept when the uninstall does not finish; the
# container's own log stops while containerd restarts) and is copied here once it ends.
on_host_outside() {
    pid=$(host_pid)
    from=$(($(wc -l <"$HOST$LOG" 2>/dev/null || echo 0) + 1))
    nsenter -t "$pid" -m -u -i -n -- /usr/bin/env -i PATH="$HOST_PATH" HOME=/root setsid -w /bin/sh -c '
        while IFS=: read -r _ ctrl path; do
            if [ -z "$ctrl" ]; then
                base=/sys/fs/cgroup/unified
                [ -d "$base" ] || base=/sys/fs/cgroup
            else
                base=/sys/fs/cgroup/${ctrl#name=}
            fi
            echo $$ >"$base$path/cgroup.procs" 2>/dev/null || true
        done <"/proc/$0/cgroup"
        log=$1
        shift
        exec "$@" >>"$log" 2>&1' "$pid" "$LOG" "$@"
    rc=$?
    tail -n "+$from" "$HOST$LOG" >&2 || true
    return $rc
}

# the topmost directory of PATH that is not there (empty when PATH is)
top_missing() {
    d=$1 top=""
    while [ -n "$d" ] && [ ! -d "$HOST$d" ]; do
        top=$d
        d=${d%/*}
    done
    echo "$top"
}

# the daemon's setting KEY from its config.yaml (a top-level "key: value" line), else DEFAULT
setting() {
    v=$(sed -n "s/^$1:[[:space:]]*\\([^#[:space:]]*\\).*/\\1/p" /etc/vmsandbox-installer/config.yaml | head -n 1)
    echo "${v:-$2}"
}

# set | remove: the node's vmsandbox.dev/runtime label, with the service account's credentials
label() {
    server=${VMSANDBOX_API_SERVER:-}
    [ -n "$server" ] || server="https://${KUBERNETES_SERVICE_HOST}:${KUBERNETES_SERVICE_PORT}"
    flag=""
    [ "$1" = set ] || flag=--remove
    (
        VMSANDBOX_API_TOKEN=$(cat "$SA/token")
        VMSANDBOX_API_CA=$(cat "$SA/ca.crt")
        export VMSANDBOX_API_TOKEN VMSANDBOX_API_CA PATH="$HOST_PATH"
        nsenter -t "$(host_pid)" -m -u -i -n -- "$PREFIX/venv/bin/vmsandbox" node label "$NODE_NAME" $flag \
            --server "$server" --kubeconfig "${VMSANDBOX_KUBELET_KUBECONFIG:-}"
    )
}

uninstall() {
    trap '' TERM INT
    rm -f "$READY"
    say "uninstalling"
    label remove || say "the node's label was not removed"
    socket=$(setting socket_path /run/vmsandbox/vmsandbox.sock)
    state=$(setting state_dir /var/lib/vmsandbox/state)
    if [ -n "$DAEMON" ] && kill -0 "$DAEMON" 2>/dev/null; then
        say "removing the daemon's VM pods"
        on_host "$PREFIX/venv/bin/python" -m cli.teardown sandboxes "$socket" --state-dir "$state" || say "not every VM pod was removed"
        say "stopping the daemon (pid $DAEMON)"
        kill "$DAEMON" 2>/dev/null || true
        wait "$DAEMON" 2>/dev/null || true
    fi
    status=0
    if [ -x "$HOST$PREFIX/venv/bin/vmsandbox" ]; then
        on_host_outside "$PREFIX/venv/bin/vmsandbox" node uninstall --prefix "$PREFIX" --restart-command "$RESTART" || status=1
    fi
    if [ $status = 0 ]; then
        # the prefix, and the directories above it that the install made
        made=$(cat "$HOST$PREFIX/.made-dirs" 2>/dev/null || true)
        rm -rf "$HOST$PREFIX"
        case $PREFIX in
        "$made"/*) rm -rf "${HOST:?}$made" ;;
        esac
        say "uninstalled: $PREFIX removed"
    else
        say "the uninstall did not finish: $PREFIX kept (its install-record.json names what is left, node.log why)"
    fi
    exit $status
}

# each step checked: `set -e` does not hold in a function called from `||`
install() {
    say "copying the payload to $PREFIX"
    made=$(top_missing "$PREFIX")
    mkdir -p "$HOST$PREFIX/etc" "$HOST$PREFIX/images" || return 1
    [ -z "$made" ] || echo "$made" >"$HOST$PREFIX/.made-dirs" || return 1
    chmod 0755 "$HOST$PREFIX" "$HOST$PREFIX/images" || return 1
    rm -rf "$HOST$PREFIX/payload" "$HOST$PREFIX/images/default" || return 1
    cp -a /payload "$HOST$PREFIX/payload" || return 1
    mv "$HOST$PREFIX/payload/images/default" "$HOST$PREFIX/images/default" || return 1
    rmdir "$HOST$PREFIX/payload/images" || return 1
    cp /etc/vmsandbox-installer/config.yaml "$HOST$PREFIX/etc/config.yaml" || return 1
    say "the venv, with $PYTHON"
    on_host "$PYTHON" -m venv --clear "$PREFIX/venv" || return 1
    on_host "$PREFIX/venv/bin/pip" install --quiet --no-index --find-links "$PREFIX/payload/wheels" vmsandbox || return 1
    on_host_outside "$PREFIX/venv/bin/vmsandbox" node install --prefix "$PREFIX" \
        --containerd-config "${VMSANDBOX_CONTAINERD_CONFIG:-/etc/containerd/config.toml}" \
        --drop-in "${VMSANDBOX_DROP_IN:-/etc/containerd/conf.d/vmsandbox.toml}" \
        --launcher-dir "${VMSANDBOX_LAUNCHER_DIR:-/usr/local/bin}" --restart-command "$RESTART" || return 1
}

trap uninstall TERM INT
install || { say "the install failed"; uninstall; }
socket=$(setting socket_path /run/vmsandbox/vmsandbox.sock)
say "starting the daemon"
# a simple command in the background, so that $! is the daemon's pid (nsenter and env exec it)
nsenter -t "$(host_pid)" -m -u -i -n -- /usr/bin/env -i PATH="$HOST_PATH" HOME=/root \
    "$PREFIX/venv/bin/vmsandbox" serve --config "$PREFIX/etc/config.yaml" &
DAEMON=$!
n=0
until [ -S "$HOST$socket" ]; do
    kill -0 "$DAEMON" 2>/dev/null || { say "the daemon exited"; uninstall; }
    n=$((n + 1))
    [ $n -lt 120 ] || { say "the daemon did not listen on $socket within 120 s"; uninstall; }
    sleep 1
done
label set
touch "$READY"
say "installed; the daemon runs (pid $DAEMON)"
while kill -0 "$DAEMON" 2>/dev/null; do
    wait "$DAEMON" || true
done
say "the daemon exited"
uninstall
