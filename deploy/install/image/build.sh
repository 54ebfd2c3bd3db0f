#!/usr/bin/env bash
# The installer's image, vmsandbox-installer (deploy/install/daemonset.yaml), built with buildah from
# scratch (vfs storage of its own, nothing mounted, no container daemon) and pushed:
#
#   deploy/install/image/build.sh DEST        # e.g. registry.example:5000/vmsandbox/installer:0.1.0
#
# It holds busybox-static (sh, nsenter, cp, ...), a wheelhouse (the project and its dependencies at
# the versions of $VMSANDBOX_VENV, default .venv; the host's Python must be of the same minor
# version), the guest image the profiles boot ($VMSANDBOX_IMAGE_DIR, default
# /var/lib/vmsandbox/images/default: images/build.sh makes it), the default profiles
# (deploy/profiles.yaml) and the entrypoint (entrypoint.sh beside this script). DEST is reached
# over plain HTTP when INSECURE=1; a DEST with a transport of buildah push (dir:PATH, oci-archive:PATH)
# is pushed there.
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
DEST=${1:?usage: $0 DEST}
VENV=${VMSANDBOX_VENV:-$REPO_ROOT/.venv}
GUEST=${VMSANDBOX_IMAGE_DIR:-/var/lib/vmsandbox/images/default}
BUSYBOX=${BUSYBOX:-/bin/busybox}
APPLETS=(sh cp mv rm rmdir mkdir chmod cat sed head tail wc sleep kill touch nsenter env ls echo test "[")

die() { echo "build.sh: $*" >&2; exit 1; }
[[ -x $VENV/bin/python ]] || die "no venv at $VENV"
[[ -f $GUEST/vmlinux && -f $GUEST/initramfs.img ]] || die "no guest image in $GUEST (images/build.sh)"
file -L "$BUSYBOX" | grep -q 'statically linked' || die "$BUSYBOX is not busybox-static"

work=$(mktemp -d /var/tmp/vmsandbox-installer-build.XXXXXX)
b=(buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs)
cleanup() {
    "${b[@]}" rm --all >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

ctx=$work/ctx
mkdir -p "$ctx/bin" "$ctx/installer" "$ctx/payload/wheels" "$ctx/payload/images/default" "$ctx/tmp" "$work/src"
cp "$BUSYBOX" "$ctx/bin/busybox"
for a in "${APPLETS[@]}"; do ln -s busybox "$ctx/bin/$a"; done
mkdir -p "$ctx/usr/bin" && ln -s ../../bin/busybox "$ctx/usr/bin/env"
chmod 1777 "$ctx/tmp"

# the project's packages as they are in this tree, built without network into a wheel; its
# dependencies at the venv's versions (pip's cache, else the index)
cp "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/README.md" "$work/src/"
for pkg in vmsandbox shim cli gen; do
    (cd "$REPO_ROOT" && find "$pkg" -name __pycache__ -prune -o -type f \( -name '*.py' -o -name '*.pyi' -o -name py.typed \) -print) |
        while read -r f; do mkdir -p "$work/src/$(dirname "$f")" && cp "$REPO_ROOT/$f" "$work/src/$f"; done
done
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^vmsandbox' >"$work/constraints.txt"
"$VENV/bin/python" -m pip wheel --quiet --no-build-isolation -c "$work/constraints.txt" -w "$ctx/payload/wheels" "$work/src"
find "$GUEST" -maxdepth 1 -type f -exec cp {} "$ctx/payload/images/default/" \;
cp "$REPO_ROOT/deploy/profiles.yaml" "$ctx/payload/profiles.yaml"
cp "$REPO_ROOT/deploy/install/image/entrypoint.sh" "$ctx/installer/entrypoint.sh"
chmod -R a+rX "$ctx"

container=$("${b[@]}" from scratch)
"${b[@]}" copy "$container" "$ctx" / >/dev/null
"${b[@]}" config --cmd '["/bin/sh", "/installer/entrypoint.sh"]' --label app.kubernetes.io/part-of=vmsandbox "$container"
"${b[@]}" commit --quiet --format docker "$container" vmsandbox-installer >/dev/null
tls=()
[[ ${INSECURE:-} != 1 ]] || tls=(--tls-verify=false)
case $DEST in
docker://* | dir:* | oci:* | oci-archive:* | docker-archive:*) ;; # a transport of buildah push
*) DEST=docker://$DEST ;;
esac
"${b[@]}" push --quiet "${tls[@]}" --format v2s2 vmsandbox-installer "$DEST"
echo "pushed $DEST"
