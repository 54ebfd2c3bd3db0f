#!/usr/bin/env bash
# Build the vmsandbox guest image: OUTDIR/vmlinux, OUTDIR/initramfs.img, OUTDIR/manifest.json.
#
#   images/build.sh OUTDIR
#
# The kernel comes from Debian's linux-image-amd64 (resolved to the concrete linux-image-*-amd64
# package), fetched with `apt-get download` into OUTDIR/.cache and unpacked there: nothing is
# installed on the host. The uncompressed vmlinux (PVH entry, boots much faster under TCG than the
# bzImage) is cut out of the vmlinuz's XZ payload. The initramfs holds busybox-static, the virtio
# modules the guest needs (in dependency order, resolved with depmod/modprobe on the unpacked tree),
# /init (images/guest/init), the agent (images/agent, Go standard library only, built static with
# Debian's golang-go) and Debian's crun with its shared libraries (images/guest/packages, fetched
# the same way as the kernel).
#
# Idempotent: when OUTDIR/manifest.json records the same build inputs (kernel package + version,
# busybox version, hash of the images/ sources, compression) and both outputs still match their
# recorded sha256, nothing is done. (The Go toolchain version and the versions of the packages
# in images/guest/packages are build inputs too.)
#
# Environment:
#   VMSANDBOX_KERNEL_PACKAGE      concrete kernel package (default: what linux-image-amd64 depends on)
#   VMSANDBOX_INITRAMFS_COMPRESS  none | gzip (default none: measured faster to boot under TCG)
set -euo pipefail

export LC_ALL=C
export PATH="$PATH:/usr/sbin:/sbin"
umask 022

die() { echo "build.sh: $*" >&2; exit 1; }
log() { echo "build.sh: $*" >&2; }

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
for tool in apt-cache apt-get dpkg-deb dpkg-query depmod modprobe xz cpio sha256sum busybox go; do
    command -v "$tool" >/dev/null || die "missing tool: $tool"
done

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
CACHE="$OUT/.cache"
COMPRESS="${VMSANDBOX_INITRAMFS_COMPRESS:-none}"
case "$COMPRESS" in none|gzip) ;; *) die "VMSANDBOX_INITRAMFS_COMPRESS must be none or gzip" ;; esac

# --- resolve the inputs ---------------------------------------------------------------------------
candidate() { apt-cache policy "$1" | awk '$1 == "Candidate:" { print $2 }'; }

KPKG="${VMSANDBOX_KERNEL_PACKAGE:-}"
if [ -z "$KPKG" ]; then
    meta_ver=$(candidate linux-image-amd64)
    [ -n "$meta_ver" ] && [ "$meta_ver" != "(none)" ] \
        || die "apt knows no linux-image-amd64 (run apt-get update?)"
    KPKG=$(apt-cache show "linux-image-amd64=$meta_ver" \
        | sed -n 's/^Depends: //p' | sed -n 1p | tr ',|' '\n\n' \
        | sed -n 's/^ *\(linux-image-[0-9][^ ]*-amd64\).*/\1/p' | sed -n 1p)
    [ -n "$KPKG" ] || die "cannot resolve linux-image-amd64 $meta_ver to a concrete kernel package"
fi
KVER_PKG=$(candidate "$KPKG")
[ -n "$KVER_PKG" ] && [ "$KVER_PKG" != "(none)" ] || die "apt has no candidate for $KPKG"
BUSYBOX_VER=$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null) \
    || die "busybox-static is not installed (apt-get install --no-install-recommends busybox-static)"
BUSYBOX=$(command -v busybox)
if command -v file >/dev/null && file -L "$BUSYBOX" | grep 'dynamically linked' >/dev/null; then
    die "$BUSYBOX is not static"
fi

mapfile -t GUEST_PKGS < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$SRC/guest/packages")
PKG_VERSIONS=()
for pkg in "${GUEST_PKGS[@]}"; do
    ver=$(candidate "$pkg")
    [ -n "$ver" ] && [ "$ver" != "(none)" ] || die "apt has no candidate for $pkg (run apt-get update?)"
    PKG_VERSIONS+=("$pkg=$ver")
done
GO_VERSION=$(go env GOVERSION)

SOURCES_HASH=$(cd "$SRC" && find . -type f ! -name '*.md' -print0 | sort -z \
    | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
INPUTS_HASH=$(printf '%s\n' "$KPKG=$KVER_PKG" "busybox-static=$BUSYBOX_VER" \
    "sources=$SOURCES_HASH" "compress=$COMPRESS" "go=$GO_VERSION" "${PKG_VERSIONS[@]}" | sha256sum | cut -d' ' -f1)

# --- up to date? ----------------------------------------------------------------------------------
manifest_field() { sed -n "s/^  \"$1\": \"\([^\"]*\)\".*/\1/p" "$OUT/manifest.json"; }
if [ -f "$OUT/manifest.json" ] && [ -f "$OUT/vmlinux" ] && [ -f "$OUT/initramfs.img" ] \
    && [ "$(manifest_field inputs_sha256)" = "$INPUTS_HASH" ] \
    && [ "$(manifest_field vmlinux_sha256)" = "$(sha256sum <"$OUT/vmlinux" | cut -d' ' -f1)" ] \
    && [ "$(manifest_field initramfs_sha256)" = "$(sha256sum <"$OUT/initramfs.img" | cut -d' ' -f1)" ]
then
    log "up to date: $OUT ($KPKG $KVER_PKG, inputs $INPUTS_HASH)"
    exit 0
fi

START=$(date +%s.%N)
WORK=$(mktemp -d "$OUT/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# --- fetch packages into the cache (never installed) ----------------------------------------------
mkdir -p "$CACHE"
# Prints the cached .deb of package $1 at version $2, downloading it when missing.
fetch_deb() {
    local pkg=$1 ver=$2 deb
    deb=$(find "$CACHE" -maxdepth 1 -name "${pkg}_*.deb" | while read -r f; do
        [ "$(dpkg-deb -f "$f" Version)" = "$ver" ] && echo "$f"; done | sed -n 1p)
    if [ -z "$deb" ]; then
        log "downloading $pkg=$ver"
        (cd "$CACHE" && apt-get download -q -o APT::Sandbox::User=root "$pkg=$ver" >&2) \
            || die "apt-get download $pkg=$ver failed (stale apt lists? run apt-get update)"
        deb=$(find "$CACHE" -maxdepth 1 -name "${pkg}_*.deb" | while read -r f; do
            [ "$(dpkg-deb -f "$f" Version)" = "$ver" ] && echo "$f"; done | sed -n 1p)
        [ -n "$deb" ] || die "apt-get download left no .deb for $pkg in $CACHE"
        find "$CACHE" -maxdepth 1 -name "${pkg}_*.deb" ! -path "$deb" -delete
    fi
    echo "$deb"
}
DEB=$(fetch_deb "$KPKG" "$KVER_PKG")
KROOT="$WORK/kernel"
dpkg-deb -x "$DEB" "$KROOT"
VMLINUZ=$(find "$KROOT/boot" -name 'vmlinuz-*' | sed -n 1p)
[ -n "$VMLINUZ" ] || die "$DEB holds no /boot/vmlinuz-*"
KREL=${VMLINUZ##*/vmlinuz-}
[ -d "$KROOT/lib/modules/$KREL" ] || die "$DEB holds no /lib/modules/$KREL"

# --- vmlinux: the ELF inside the bzImage's XZ payload ---------------------------------------------
VMLINUX="$WORK/vmlinux"
found=""
for off in $(grep -obUaP '\xfd7zXZ\x00' "$VMLINUZ" | cut -d: -f1); do
    # --single-stream: stop at the end of the XZ stream, ignore what the bzImage appends.
    # (tail may die of SIGPIPE when xz stops early: that is fine, xz's status decides.)
    if { tail -c +"$((off + 1))" "$VMLINUZ" || :; } | xz -dc --single-stream >"$VMLINUX" 2>/dev/null \
        && [ "$(head -c4 "$VMLINUX" | od -An -tx1 | tr -d ' ')" = "7f454c46" ]; then
        found=$off
        break
    fi
done
[ -n "$found" ] || die "no XZ stream holding an ELF in $VMLINUZ"
if command -v readelf >/dev/null; then
    # Xen ELF note 18 (XEN_ELFNOTE_PHYS32_ENTRY) is the PVH entry QEMU's -kernel needs for an ELF.
    readelf -n "$VMLINUX" \
        | grep -E 'Xen[[:space:]]+0x[0-9a-f]+[[:space:]]+(Unknown note type: \(0x00000012\)|.*PHYS32_ENTRY)' >/dev/null \
        || die "$VMLINUX has no PVH (Xen PHYS32_ENTRY) note: QEMU cannot boot it directly"
else
    log "readelf missing (binutils): PVH note not checked"
fi

# --- modules: resolve dependencies on the unpacked tree -------------------------------------------
depmod -b "$KROOT" "$KREL"
mapfile -t WANTED < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$SRC/guest/modules")
INITRD="$WORK/initrd"
MODDIR="lib/modules/$KREL"
mkdir -p "$INITRD/$MODDIR" "$INITRD/etc/vmsandbox"
: >"$INITRD/etc/vmsandbox/modules"
# --show-depends prints "insmod PATH" lines, dependencies first; -a: every argument is a module.
modprobe -d "$KROOT" -S "$KREL" -a --show-depends "${WANTED[@]}" \
    | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' | while read -r ko; do
    rel=${ko#"$KROOT/$MODDIR/"}
    # CPU-specific crypto (crc32c-intel, a soft dependency of libcrc32c, which erofs needs) cannot
    # load on the TCG guest's qemu64 CPU; the generic implementation beside it serves instead
    case "$rel" in */arch/x86/crypto/* | arch/x86/crypto/*) continue ;; esac
    mkdir -p "$INITRD/$MODDIR/$(dirname "$rel")"
    case "$rel" in
        *.ko.xz) xz -dc "$ko" >"$INITRD/$MODDIR/${rel%.xz}"; rel=${rel%.xz} ;;
        *.ko.zst) zstd -qdc "$ko" >"$INITRD/$MODDIR/${rel%.zst}"; rel=${rel%.zst} ;;
        *.ko.gz) gzip -dc "$ko" >"$INITRD/$MODDIR/${rel%.gz}"; rel=${rel%.gz} ;;
        *.ko) cp "$ko" "$INITRD/$MODDIR/$rel" ;;
        *) die "unexpected module file $ko" ;;
    esac
    echo "/$MODDIR/$rel" >>"$INITRD/etc/vmsandbox/modules"
done
[ -s "$INITRD/etc/vmsandbox/modules" ] || die "no module resolved from $SRC/guest/modules"

# --- initramfs tree -------------------------------------------------------------------------------
mkdir -p "$INITRD"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,run,tmp}
chmod 1777 "$INITRD/tmp"
cp "$BUSYBOX" "$INITRD/bin/busybox"
"$BUSYBOX" --list-full | while read -r applet; do
    [ -e "$INITRD/$applet" ] || ln -s /bin/busybox "$INITRD/$applet"
done
install -m 0755 "$SRC/guest/init" "$INITRD/init"
# The kernel opens /dev/console for init's stdio before /init runs; /init remounts devtmpfs
# over /dev and reopens the console, so this node only matters for the first lines.
if [ "$(id -u)" = 0 ]; then
    mknod -m 0600 "$INITRD/dev/console" c 5 1
else
    log "not root: no /dev/console node in the initramfs (init reopens it from devtmpfs)"
fi

# --- the agent: static, Go standard library only (no module downloads) ---------------------------
(cd "$SRC/agent" && CGO_ENABLED=0 GOFLAGS=-mod=mod GOPROXY=off GOCACHE="$CACHE/go-build" GOPATH="$CACHE/gopath" \
    go build -trimpath -ldflags='-s -w' -o "$INITRD/sbin/vmsandbox-agent" .) \
    || die "building the agent (images/agent) failed"

# --- crun and the libraries it links, from Debian packages ---------------------------------------
DEBROOT="$WORK/debroot"
for pv in "${PKG_VERSIONS[@]}"; do
    dpkg-deb -x "$(fetch_deb "${pv%%=*}" "${pv#*=}")" "$DEBROOT"
done
[ -x "$DEBROOT/usr/bin/crun" ] || die "no /usr/bin/crun in the packages of $SRC/guest/packages"
cp -a "$DEBROOT/usr/bin/crun" "$INITRD/usr/bin/crun"
# Only the libraries crun links (resolved by the packages' own loader, inside the unpacked tree).
LIBPATH="$DEBROOT/lib/x86_64-linux-gnu:$DEBROOT/usr/lib/x86_64-linux-gnu"
LDSO="$DEBROOT/lib64/ld-linux-x86-64.so.2"
[ -e "$LDSO" ] || die "no dynamic loader in the packages of $SRC/guest/packages (libc6?)"
deps=$("$LDSO" --library-path "$LIBPATH" --list "$DEBROOT/usr/bin/crun") \
    || die "cannot resolve crun's libraries: $deps"
if grep 'not found' <<<"$deps" >&2; then
    die "crun needs a library not in $SRC/guest/packages"
fi
mkdir -p "$INITRD/lib64" "$INITRD/lib/x86_64-linux-gnu"
cp -L "$LDSO" "$INITRD/lib64/ld-linux-x86-64.so.2"
awk '$2 == "=>" && $1 !~ /\// { print $1 " " $3 }' <<<"$deps" | while read -r soname path; do
    case "$path" in "$DEBROOT"/*) ;; *) die "crun's $soname resolved outside the packages: $path" ;; esac
    cp -L "$path" "$INITRD/lib/x86_64-linux-gnu/$soname"
done
if [ "$(id -u)" = 0 ]; then
    # (crun itself re-executes through /proc, which a chroot lacks: let its loader resolve it)
    chroot "$INITRD" /lib64/ld-linux-x86-64.so.2 --list /usr/bin/crun >/dev/null \
        || die "crun's libraries do not resolve in the guest tree"
fi
CRUN_VERSION=$(dpkg-deb -f "$(fetch_deb crun "$(candidate crun)")" Version)

find "$INITRD" -exec touch -h -d @0 {} +

IMG="$WORK/initramfs.img"
(cd "$INITRD" && find . -mindepth 1 -print0 | sort -z \
    | cpio --null --create --format=newc --owner=0:0 --reproducible --quiet) >"$WORK/initramfs.cpio"
case "$COMPRESS" in
    none) mv "$WORK/initramfs.cpio" "$IMG" ;;
    gzip) gzip -9 -n -c "$WORK/initramfs.cpio" >"$IMG" ;;
esac

# --- publish --------------------------------------------------------------------------------------
VMLINUX_SHA=$(sha256sum <"$VMLINUX" | cut -d' ' -f1)
IMG_SHA=$(sha256sum <"$IMG" | cut -d' ' -f1)
chmod 0644 "$VMLINUX" "$IMG"
chmod 0755 "$OUT"
mv -f "$VMLINUX" "$OUT/vmlinux"
mv -f "$IMG" "$OUT/initramfs.img"
modules_json=$(sed 's/.*/"&"/' "$INITRD/etc/vmsandbox/modules" | paste -sd, | sed 's/,/, /g')
cat >"$WORK/manifest.json" <<EOF
{
  "format": 1,
  "kernel_release": "$KREL",
  "kernel_package": "$KPKG",
  "kernel_package_version": "$KVER_PKG",
  "busybox_version": "$BUSYBOX_VER",
  "crun_version": "$CRUN_VERSION",
  "go_version": "$GO_VERSION",
  "initramfs_compression": "$COMPRESS",
  "vmlinux_sha256": "$VMLINUX_SHA",
  "initramfs_sha256": "$IMG_SHA",
  "sources_sha256": "$SOURCES_HASH",
  "inputs_sha256": "$INPUTS_HASH",
  "agent_channel": "io.vmsandbox.agent.0",
  "kernel_cmdline_hint": "console=ttyS0 quiet panic=-1 cryptomgr.notests",
  "modules": [$modules_json]
}
EOF
chmod 0644 "$WORK/manifest.json"
mv -f "$WORK/manifest.json" "$OUT/manifest.json"

log "built $OUT: $KPKG $KVER_PKG (kernel $KREL), vmlinux $(stat -c %s "$OUT/vmlinux") B," \
    "initramfs $(stat -c %s "$OUT/initramfs.img") B ($COMPRESS), $(awk -v s="$START" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }') s"
# libvirt's qemu user must reach the files: warn when a parent directory is not traversable.
d="$OUT"
while [ "$d" != / ]; do
    if [ "$(( $(stat -c %#a "$d") & 1 ))" = 0 ]; then
        log "warning: $d is not world-traversable (mode $(stat -c %a "$d")): the qemu user may not read the image"
    fi
    d=$(dirname "$d")
done
