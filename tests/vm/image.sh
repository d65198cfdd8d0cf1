#!/bin/bash
# Cached QEMU guest image for the end-to-end tests: Debian 13 "trixie" with real systemd
# (PID 1, cgroup v2, dbus), booted under TCG with emulated NUMA nodes.
#
#   tests/vm/image.sh key               print the cache key (16 hex digits)
#   tests/vm/image.sh build             build the image unless cached; print its directory
#   tests/vm/image.sh run SHARE TOPO    boot it, run SHARE/test.sh as root in the guest;
#                                       exit status = the test's, 99 when there is none
#       TOPO: 2x2     2 NUMA nodes x 2 CPUs (2 sockets x 2 cores)
#             4x1     4 NUMA nodes x 1 CPU
#             2x2smt  2 NUMA nodes = 2 sockets x 1 core x 2 SMT threads
#
# Environment:
#   NUMA_INFER_VM_CACHE       cache root (default ~/.cache/numa-infer/vm); the image lives
#                             in <cache>/<key>/{img.raw,vmlinux,initrd.img,manifest.txt}
#   NUMA_INFER_LLAMA_WHEEL    prebuilt llama-cpp-python wheel baked into the guest venv
#   NUMA_INFER_DEBIAN_MIRROR  Debian mirror for the build (default http://deb.debian.org/debian)
#   VM_TIMEOUT                seconds before `run` kills the guest (default 900)
#
# Guest contract (what SHARE/test.sh can rely on):
#   - runs as root from e2e-runner.service once `systemctl is-system-running --wait`
#     returns, with cwd /mnt/share (the 9p share, read-write) and
#     PATH=/opt/llm/bin:... so python/python3/pip are the baked venv's;
#   - /opt/llm: Python 3.13 venv with llama-cpp-python[server] and everything in
#     tests/vm/guest-requirements.txt; no network at all (-nic none), so anything else
#     (models, the numa-infer wheel) comes through the share per run;
#   - its stdout+stderr go to SHARE/out.txt and the serial console (SHARE/serial.log),
#     framed by "=== E2E-BEGIN ..." / "=== E2E-END rc=N ..." lines; its exit status
#     goes to SHARE/rc; then the guest powers off.
#   - the kernel command line carries e2e.topo=TOPO and e2e.nodes=N.
#
# Reference recipe and measured facts: /work/shared/vm/{numa-vm.sh,README.md}.
set -euo pipefail
umask 022 # the guest runs services as other users too: everything baked must be world-readable

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF=$HERE/$(basename "${BASH_SOURCE[0]}")
REQS=$HERE/guest-requirements.txt
CACHE=${NUMA_INFER_VM_CACHE:-$HOME/.cache/numa-infer/vm}
WHEEL=${NUMA_INFER_LLAMA_WHEEL:?set NUMA_INFER_LLAMA_WHEEL to the llama-cpp-python wheel (tests/vm/run_suite.py does)}
MIRROR=${NUMA_INFER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Dependencies of numa-infer's Debian package (debian/control), kept in the guest's apt cache.
DEB_DEPENDS="python3-pydantic python3-psutil python3-sdnotify python3-prometheus-client python3-tomlkit haproxy"

# Everything that shapes the image is a constant in this file, not an environment knob:
# the key hashes this file, so changing any of these makes a new image.
SUITE=trixie
IMG_SIZE=4G # sparse; the built root is ~1.2 GB, the rest is room for tests and a loaded container image (snapshot=on: writes are discarded)
KEEP=2      # image directories kept in the cache (most recently used first)
GUEST_HOSTNAME="numa-e2e"
PACKAGES=systemd,systemd-sysv,udev,dbus,python3,python3-venv,libgomp1,numactl,procps,curl,iproute2,haproxy,linux-image-amd64,initramfs-tools,lz4,util-linux,ca-certificates
# The container group runs numa-infer's image under podman (crun, cgroup v2): rootful, with
# netavark's bridge (nftables) for the published front-door port.
PACKAGES=$PACKAGES,podman,crun,conmon,netavark,aardvark-dns,nftables,catatonit
# Units that cost boot time under TCG or misbehave without a console (from the reference;
# serial-getty@ttyS0 in particular: its hangup swallows console output).
MASK_UNITS=(serial-getty@ttyS0.service getty@tty1.service apt-daily.timer apt-daily-upgrade.timer
  dpkg-db-backup.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer systemd-pstore.service
  modprobe@drm.service modprobe@fuse.service modprobe@loop.service modprobe@dm_mod.service
  systemd-binfmt.service proc-sys-fs-binfmt_misc.automount sys-kernel-debug.mount
  sys-kernel-tracing.mount dev-hugepages.mount
  podman-auto-update.timer podman-restart.service
  haproxy.service) # Debian's own HAProxy instance: numa-infer runs its own (numa-infer-frontdoor.service)

log() { echo "image.sh: $*" >&2; }
die() { # die [STATUS] MESSAGE
  local rc=1
  [[ $1 =~ ^[0-9]+$ ]] && { rc=$1; shift; }
  log "error: $*"
  exit "$rc"
}
usage() { sed -n '2,12p' "$SELF" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# ---------------------------------------------------------------------------- key
# sha256 over the recipe (this file), the pinned guest requirements and the llama wheel's
# own sha256 (hashed once more, so swapping the wheel for another build changes the key
# even when its file name stays the same).
compute_key() {
  [ -f "$REQS" ] || die "missing $REQS"
  [ -f "$WHEEL" ] || die "llama-cpp-python wheel not found: $WHEEL (set NUMA_INFER_LLAMA_WHEEL)"
  WHEEL_SHA=$(sha256sum <"$WHEEL" | cut -d' ' -f1)
  KEY=$({
    echo "recipe $(sha256sum <"$SELF" | cut -d' ' -f1)"
    echo "requirements $(sha256sum <"$REQS" | cut -d' ' -f1)"
    echo "llama-wheel $WHEEL_SHA"
  } | sha256sum | cut -c1-16)
}

image_complete() { [ -f "$1/img.raw" ] && [ -f "$1/vmlinux" ] && [ -f "$1/initrd.img" ]; }

# ---------------------------------------------------------------------- host tools
# ensure_cmds CMD:DEBIAN_PACKAGE...: apt-get install whatever is missing (we run as root
# on a Debian/Ubuntu host); apt-get update only when the first attempt fails.
ensure_cmds() {
  local pair missing=()
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || { log "missing host packages: ${missing[*]} (not root: cannot install them)"; return 1; }
  command -v apt-get >/dev/null || { log "missing host packages: ${missing[*]} (no apt-get)"; return 1; }
  log "installing host packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${missing[@]}" >&2 ||
    { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; } ||
    { log "apt-get install ${missing[*]} failed"; return 1; }
}

# ---------------------------------------------------------------- mounts / cleanup
# Everything mounted at or below $1, deepest first.
mounts_under() {
  findmnt -rn -o TARGET | awk -v p="$1" '$0 == p || index($0, p "/") == 1' | sort -r
}
unmount_under() {
  local m
  for m in $(mounts_under "$1"); do umount "$m" 2>/dev/null || umount -l "$m" || true; done
  [ -z "$(mounts_under "$1")" ]
}
# Delete a build directory, but never while anything (the host's /dev, /proc...) is still
# mounted inside it; --one-file-system is the second belt.
remove_build_dir() {
  [ -e "$1" ] || return 0
  unmount_under "$1" || { log "cannot unmount everything under $1; leaving it in place"; return 1; }
  rm -rf --one-file-system "$1"
}

# --------------------------------------------------------------------------- build
cmd_build() {
  [ "$(id -u)" = 0 ] || die "build needs root (debootstrap, chroot, mounts)"
  compute_key
  local dir=$CACHE/$KEY
  if image_complete "$dir"; then
    touch "$dir"
    log "cached: $dir"
    echo "$dir"
    return 0
  fi
  ensure_cmds debootstrap:debootstrap mkfs.ext4:e2fsprogs zstd:zstd xz:xz-utils flock:util-linux \
    findmnt:util-linux qemu-system-x86_64:qemu-system-x86 || die "host tools missing"
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || ensure_cmds gpgv:debian-archive-keyring || true
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || die "no Debian archive keyring (apt-get install debian-archive-keyring)"

  mkdir -p "$CACHE"
  # One build at a time per cache: a second `build` waits here, then finds the image cached.
  exec 9>"$CACHE/.lock"
  flock 9
  if image_complete "$dir"; then
    touch "$dir"
    log "cached (built meanwhile): $dir"
    echo "$dir"
    return 0
  fi
  # We hold the lock, so any .build-* directory is left over from a killed build
  # (SIGKILL skips our trap): clear it, mounts first.
  local stale
  for stale in "$CACHE"/.build-*; do [ -e "$stale" ] && { log "removing stale $stale"; remove_build_dir "$stale"; }; done

  # Build under a temporary name in the cache directory itself (same filesystem) and
  # rename it to <key> only when complete: a half-built image never looks cached.
  BUILD=$CACHE/.build-$KEY-$$
  trap 'remove_build_dir "$BUILD" || true' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP
  mkdir -p "$BUILD" "$CACHE/debs" "$CACHE/pip"
  local R=$BUILD/rootfs t0=$SECONDS
  log "building $KEY in $BUILD"

  # 1. Base system. --cache-dir keeps the .debs between builds (the mirror is still asked
  # for the current Release).
  log "[$((SECONDS - t0))s] debootstrap $SUITE"
  debootstrap --variant=minbase --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
    --cache-dir="$CACHE/debs" --include="$PACKAGES" "$SUITE" "$R" "$MIRROR" >&2

  # What systemctl, pip, python and update-initramfs in the chroot need (unmounted again
  # before the kernel step; the EXIT trap unmounts them on failure).
  mount -t proc proc "$R/proc"
  mount -t sysfs sysfs "$R/sys"
  mount --rbind /dev "$R/dev"
  mount --make-rslave "$R/dev" # unmounting inside must never propagate to the host's /dev

  # 2. System configuration.
  log "[$((SECONDS - t0))s] configure"
  echo "$GUEST_HOSTNAME" >"$R/etc/hostname"
  # debootstrap copies the host's /etc/hosts (or writes none): localhost must resolve in the
  # guest (uvicorn --host localhost fails otherwise).
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
    "$GUEST_HOSTNAME" >"$R/etc/hosts"
  # The root device is virtio disk 0; snapshot=on makes every boot start from the same
  # fresh filesystem, so no fsck pass.
  echo '/dev/vda / ext4 defaults,noatime 0 0' >"$R/etc/fstab"
  mkdir -p "$R/mnt/share" "$R/etc/systemd/journald.conf.d" "$R/usr/local/sbin"
  printf '[Journal]\nStorage=volatile\n' >"$R/etc/systemd/journald.conf.d/volatile.conf"
  write_runner "$R"
  chroot "$R" systemctl enable -q e2e-runner.service
  chroot "$R" systemctl mask -q "${MASK_UNITS[@]}"

  # 3. The venv, natively in the chroot (pip under TCG takes minutes). The chroot shares
  # the host's network.
  mkdir -p "$R/root/.cache/pip"
  mount --bind "$CACHE/pip" "$R/root/.cache/pip" # downloads survive rebuilds; not in the image
  log "[$((SECONDS - t0))s] venv /opt/llm"
  bake_venv "$R"
  umount "$R/root/.cache/pip"

  # 3b. An offline apt archive for the Debian package test (issue: `apt install ./numa-infer_*.deb`
  # in a guest without network): the package's dependencies are downloaded, not installed,
  # and the package lists are kept, so apt resolves them from the guest's own cache.
  log "[$((SECONDS - t0))s] apt cache for numa-infer's .deb dependencies"
  in_chroot "$R" apt-get update -q >&2
  in_chroot "$R" apt-get install -y -q --download-only $DEB_DEPENDS >&2

  # 4. Small initrd: the root disk needs only virtio_pci, virtio_blk and ext4 (7 MB
  # instead of ~36 MB with MODULES=most; the 9p modules load later from the root fs).
  log "[$((SECONDS - t0))s] initramfs"
  sed -i 's/^MODULES=.*/MODULES=list/; s/^#\?COMPRESS=.*/COMPRESS=lz4/' "$R/etc/initramfs-tools/initramfs.conf"
  printf 'virtio_pci\nvirtio_blk\next4\n' >>"$R/etc/initramfs-tools/modules"
  in_chroot "$R" update-initramfs -u -k all >&2
  if ! { unmount_under "$R/dev" && unmount_under "$R/sys" && unmount_under "$R/proc"; }; then
    die "cannot unmount the chroot's /dev, /sys, /proc"
  fi

  # 5. Kernel and initrd out of the root fs, for -kernel/-initrd.
  log "[$((SECONDS - t0))s] kernel"
  local vmlinuz kver format
  vmlinuz=$(printf '%s\n' "$R"/boot/vmlinuz-* | sort -V | tail -n1)
  kver=${vmlinuz##*/vmlinuz-}
  cp "$R/boot/initrd.img-$kver" "$BUILD/initrd.img"
  # An uncompressed ELF vmlinux boots through the PVH entry and skips the in-guest
  # decompression (~3 s under TCG). bookworm's kernel is XZ-compressed, trixie's is zstd:
  # try each format; if none yields an ELF, boot the bzImage itself (QEMU's -kernel takes
  # either), under the same file name.
  if extract_vmlinux "$vmlinuz" "$BUILD/vmlinux"; then
    format="ELF vmlinux extracted from $(basename "$vmlinuz") ($EXTRACTED_WITH)"
  else
    cp "$vmlinuz" "$BUILD/vmlinux"
    format="bzImage $(basename "$vmlinuz") (extraction failed; booting it compressed)"
    log "warning: $format"
  fi

  # 6. Trim and seal. ldconfig/hwdb are current now; stamping /etc/.updated and
  # /var/.updated after the last change to /usr keeps ConditionNeedsUpdate= units
  # (ldconfig.service, systemd-hwdb-update.service) from running at every boot, which
  # they would otherwise do, since snapshot=on never keeps their stamps.
  log "[$((SECONDS - t0))s] trim + mkfs"
  # (The apt lists and the downloaded .debs of step 3b stay: they are the guest's offline archive.)
  rm -rf "$R"/tmp/* "$R"/var/tmp/* "$R"/root/.cache "$R"/var/log/*.log "$R"/var/log/apt
  mkdir -p "$R/tmp" "$R/var/tmp" && chmod 1777 "$R/tmp" "$R/var/tmp"
  rm -f "$R/etc/resolv.conf" && : >"$R/etc/resolv.conf" # no network in the guest; drop the host's
  chroot "$R" ldconfig
  chroot "$R" systemd-hwdb update
  touch "$R/etc/.updated" "$R/var/.updated"
  write_manifest "$R" "$kver" "$format" >"$BUILD/manifest.txt"
  mkfs.ext4 -q -F -L "$GUEST_HOSTNAME" -d "$R" "$BUILD/img.raw" "$IMG_SIZE" >&2
  remove_build_dir "$R" || die "could not remove $R"
  sync -f "$BUILD/img.raw"

  # 7. Publish atomically, then prune.
  mv -T "$BUILD" "$dir"
  trap - EXIT
  log "[$((SECONDS - t0))s] built $dir ($(du -sh --apparent-size "$dir/img.raw" | cut -f1) apparent, $(du -sh "$dir/img.raw" | cut -f1) allocated)"
  prune "$KEY"
  echo "$dir"
}

in_chroot() { # a clean environment: none of the host's PIP_*, proxies, PYTHON* leak in
  local r=$1
  shift
  chroot "$r" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 "$@"
}

bake_venv() {
  local r=$1 wheel_name
  wheel_name=$(basename "$WHEEL")
  # pip in the chroot talks to PyPI straight from here: it needs the host's resolver and
  # the host's CA bundle (on these machines TLS goes through an intercepting proxy whose CA
  # is only in the host bundle). Both are temporary and gone before mkfs.
  rm -f "$r/etc/resolv.conf" && cat /etc/resolv.conf >"$r/etc/resolv.conf"
  local ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
  [ -f "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
  cp "$ca" "$r/tmp/host-ca.pem"
  mkdir -p "$r/tmp/wheels"
  cp "$WHEEL" "$r/tmp/wheels/$wheel_name"
  cp "$REQS" "$r/tmp/guest-requirements.txt"
  # --require-hashes also for the local wheel: its hash is the one in the key.
  printf 'llama-cpp-python[server] @ file:///tmp/wheels/%s --hash=sha256:%s\n' "$wheel_name" "$WHEEL_SHA" \
    >"$r/tmp/llama-requirement.txt"
  grep -E '^setuptools==' "$REQS" >"$r/tmp/build-requirements.txt" || die "no setuptools pin in $REQS"
  local pip_env=(PIP_CERT=/tmp/host-ca.pem PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    PIP_DEFAULT_TIMEOUT=120 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off)
  local v
  for v in PIP_INDEX_URL http_proxy https_proxy HTTP_PROXY HTTPS_PROXY no_proxy NO_PROXY; do
    [ -n "${!v:-}" ] && pip_env+=("$v=${!v}")
  done
  in_chroot "$r" python3 -m venv /opt/llm
  # sdnotify exists on PyPI only as an sdist: install the pinned setuptools first and build
  # it without build isolation, so no unpinned build backend is fetched.
  in_chroot "$r" "${pip_env[@]}" /opt/llm/bin/pip install --require-hashes --no-deps \
    -r /tmp/build-requirements.txt >&2
  in_chroot "$r" "${pip_env[@]}" /opt/llm/bin/pip install --require-hashes --no-build-isolation \
    -r /tmp/guest-requirements.txt -r /tmp/llama-requirement.txt >&2
  in_chroot "$r" /opt/llm/bin/pip check >&2
  # Importing llama_cpp dlopen()s libllama/libggml (needs libgomp1): proves the libraries
  # resolve in the guest userland. llama_cpp.server.app pulls in the [server] extra.
  in_chroot "$r" /opt/llm/bin/python -c '
import llama_cpp, llama_cpp.server.app, pydantic, psutil, sdnotify, prometheus_client, sys
print("venv ok: python", sys.version.split()[0], "llama_cpp", llama_cpp.__version__,
      "pydantic", pydantic.VERSION, "psutil", psutil.__version__)' >&2
}

write_runner() {
  local r=$1
  cat >"$r/usr/local/sbin/e2e-runner" <<'EOF'
#!/bin/bash
# numa-infer e2e runner (baked by tests/vm/image.sh): once boot is complete, run the
# host's /mnt/share/test.sh as root, leave out.txt and rc on the share, power off.
exec >/dev/ttyS0 2>&1
export PATH=/opt/llm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8
state=$(systemctl is-system-running --wait)
fs=none
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /mnt/share && fs=9p
echo "=== E2E-BEGIN uptime=$(cut -d' ' -f1 /proc/uptime) state=$state share=$fs"
[ "$state" = running ] || systemctl --failed --no-legend --no-pager
rc=99
if [ "$fs" = 9p ] && [ -f /mnt/share/test.sh ]; then
  cd /mnt/share
  if [ -x test.sh ]; then ./test.sh; else bash test.sh; fi </dev/null 2>&1 | tee out.txt
  rc=${PIPESTATUS[0]}
  echo "$rc" >rc.tmp && mv rc.tmp rc
  cd /
else
  echo "e2e-runner: no share or no test.sh on it"
fi
echo "=== E2E-END rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
sync
umount /mnt/share 2>/dev/null || umount -l /mnt/share
systemctl poweroff --no-block
EOF
  chmod 755 "$r/usr/local/sbin/e2e-runner"
  # Type=exec, not oneshot: the runner waits for the boot to finish, and a oneshot unit
  # would be part of the boot it waits for.
  cat >"$r/etc/systemd/system/e2e-runner.service" <<'EOF'
[Unit]
Description=numa-infer e2e runner (runs /mnt/share/test.sh, then powers off)
After=local-fs.target

[Service]
Type=exec
ExecStart=/usr/local/sbin/e2e-runner

[Install]
WantedBy=multi-user.target
EOF
}

# extract_vmlinux BZIMAGE OUT: find a compressed payload that decompresses to an ELF file
# (the approach of the kernel's scripts/extract-vmlinux). Sets EXTRACTED_WITH.
extract_vmlinux() {
  local img=$1 out=$2 spec magic tool off
  for spec in '\x28\xb5\x2f\xfd|zstd -dcq' '\xfd\x37\x7a\x58\x5a\x00|xz -dcq' \
    '\x02\x21\x4c\x18|lz4 -dcq' '\x1f\x8b\x08|gzip -dcq'; do
    magic=${spec%%|*} tool=${spec#*|}
    command -v "${tool%% *}" >/dev/null || continue
    for off in $(LC_ALL=C grep -obUaP "$magic" "$img" | cut -d: -f1 || true); do
      # trailing bytes after the payload make the tools exit non-zero: judge the output
      tail -c +$((off + 1)) "$img" | $tool >"$out" 2>/dev/null || true
      if [ "$(head -c4 "$out" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
        EXTRACTED_WITH="${tool%% *} at offset $off"
        return 0
      fi
    done
  done
  rm -f "$out"
  return 1
}

write_manifest() {
  local r=$1 kver=$2 format=$3
  echo "key: $KEY"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  echo "suite: $SUITE from $MIRROR"
  echo "kernel: $kver; vmlinux: $format"
  echo "llama wheel: $(basename "$WHEEL") sha256=$WHEEL_SHA"
  echo "python: $(chroot "$r" /opt/llm/bin/python -c 'import sys; print(sys.version.split()[0])')"
  # shellcheck disable=SC2016 # dpkg-query's own ${field} syntax
  echo "systemd: $(chroot "$r" dpkg-query -W -f='${Version}' systemd)"
  echo
  echo "# /opt/llm: pip freeze"
  chroot "$r" /opt/llm/bin/pip freeze --all 2>/dev/null
  echo
  echo "# dpkg -l"
  # shellcheck disable=SC2016
  chroot "$r" dpkg-query -W -f='${Package} ${Version}\n'
}

prune() {
  local keep=$1 d n=0
  # image directories (16 hex digits), newest first by mtime (build and run touch the one
  # they use)
  find "$CACHE" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended -regex '.*/[0-9a-f]{16}' \
    -printf '%T@ %p\n' | sort -rn | cut -d' ' -f2- | while read -r d; do
    n=$((n + 1))
    if [ "$(basename "$d")" != "$keep" ] && [ "$n" -gt "$KEEP" ]; then
      log "pruning old image $d"
      rm -rf --one-file-system "$d"
    fi
  done
}

# ----------------------------------------------------------------------------- run
cmd_run() {
  [ $# -eq 2 ] || usage
  local share topo=$2
  [ -d "$1" ] || die 99 "share directory not found: $1"
  share=$(realpath "$1")
  [ -f "$share/test.sh" ] || die 99 "no test.sh in $share"
  # QEMU splits -virtfs/-serial arguments at commas
  [[ $share != *,* ]] || die 99 "share path must not contain a comma: $share"
  compute_key
  local dir=$CACHE/$KEY
  image_complete "$dir" ||
    die 99 "no guest image for key $KEY under $CACHE: build it first with 'tests/vm/image.sh build'"
  touch "$dir" 2>/dev/null || true # marks it recently used, for prune
  ensure_cmds qemu-system-x86_64:qemu-system-x86 ||
    die 99 "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"
  qemu-system-x86_64 -accel help 2>/dev/null | grep -qx tcg ||
    die 99 "qemu-system-x86_64 cannot run or lacks TCG: $(qemu-system-x86_64 -version 2>&1 | head -n1)"

  # TCG, not KVM: /dev/kvm on these hosts cannot run a stock Debian kernel. -svm: no
  # nested-virt flag the guest would try to use. SMT: only the Intel vendor makes the
  # guest see thread siblings under TCG (the AMD model lacks topoext).
  local smp cpu n
  case $topo in
    2x2) smp=4,sockets=2,cores=2,threads=1 cpu=max,-svm n=2 ;;
    4x1) smp=4,sockets=4,cores=1,threads=1 cpu=max,-svm n=4 ;;
    2x2smt) smp=4,sockets=2,cores=1,threads=2 cpu=max,-svm,vendor=GenuineIntel n=2 ;;
    *) die 99 "unknown topology '$topo' (2x2, 4x1 or 2x2smt)" ;;
  esac
  # 2 GiB, split evenly; CPUs numbered socket by socket, so node i holds CPUs i*per..
  local per=$((4 / n)) mem=2048 i numa=()
  for ((i = 0; i < n; i++)); do
    numa+=(-object "memory-backend-ram,id=m$i,size=$((mem / n))M"
      -numa "node,nodeid=$i,cpus=$((i * per))-$((i * per + per - 1)),memdev=m$i")
  done

  rm -f "$share/rc" "$share/rc.tmp" "$share/out.txt" "$share/serial.log"
  local timeout_s=${VM_TIMEOUT:-900} qrc=0 t0=$SECONDS
  log "booting $KEY topo=$topo (timeout ${timeout_s}s, serial: $share/serial.log)"
  # snapshot=on: writes go to a throwaway overlay, so the cached image serves every run.
  # mitigations=off: the guest kernel's speculation workarounds (KPTI: a TLB flush per
  # syscall) are pure cost under TCG.
  timeout -k 10 "$timeout_s" qemu-system-x86_64 -accel tcg -cpu "$cpu" -m "${mem}M" -smp "$smp" \
    "${numa[@]}" -nodefaults -no-user-config -vga none -display none -nic none -monitor none \
    -no-reboot -serial "file:$share/serial.log" \
    -drive "file=$dir/img.raw,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$share,mount_tag=share,security_model=none,id=share" \
    -kernel "$dir/vmlinux" -initrd "$dir/initrd.img" \
    -append "console=ttyS0 root=/dev/vda rw quiet mitigations=off e2e.topo=$topo e2e.nodes=$n" \
    </dev/null >&2 || qrc=$?
  local wall=$((SECONDS - t0)) begin
  # (systemd writes terminal resets to the console: keep only the marker line's text)
  begin=$(grep -ao -m1 $'=== E2E-BEGIN[^\r]*' "$share/serial.log" 2>/dev/null || true)
  case $qrc in
    0) ;;
    124 | 137) log "guest timed out after ${timeout_s}s (VM_TIMEOUT); see $share/serial.log" ;;
    *) log "qemu exited with status $qrc; see $share/serial.log" ;;
  esac
  if [ -f "$share/rc" ]; then
    local rc
    rc=$(cat "$share/rc")
    [[ $rc =~ ^[0-9]+$ ]] || rc=99
    log "topo=$topo rc=$rc wall=${wall}s ${begin:+(${begin#=== })}"
    exit "$rc"
  fi
  log "topo=$topo: no rc from the guest (wall=${wall}s); exit 99"
  exit 99
}

# ---------------------------------------------------------------------------- main
case ${1:-} in
  key)
    [ $# -eq 1 ] || usage
    compute_key
    echo "$KEY"
    ;;
  build)
    [ $# -eq 1 ] || usage
    cmd_build
    ;;
  run)
    shift
    cmd_run "$@"
    ;;
  *) usage ;;
esac
