#!/usr/bin/env bash
# Build the real Dockerfile with a local Docker engine where the CUDA base image cannot be pulled (no
# registry, or no GPU to use it): on a CPU stand-in for pytorch/pytorch made here, laid out like it
# (Debian bookworm, Python 3.11, requirements.txt's torch in a virtual environment at /opt/conda,
# whose bin/ comes first on PATH). The Dockerfile's own steps run as they do on the real base: the
# base's torch kept, the package installed, the unprivileged user, the entrypoint.
#
#   scripts/build_image_local.sh TAG          e.g. scripts/build_image_local.sh distqa:local
#   scripts/build_image_local.sh --base-only  the stand-in base alone (CI makes it beside make test)
#   docker run --rm --user "$(id -u):$(id -g)" -v "$PWD/results:/app/results" TAG    trains the tiny model on the CPU
#
# The stand-in base is tagged after requirements.txt's torch pin (distqa-stand-in-base:torch-2.13.0)
# and reused by later builds; `docker rmi` it to make it again. Making it needs root, debootstrap,
# pip on this host (it fetches the torch wheel) and the network (the Debian mirror and pip's index).
# Variables:
#   DEBIAN_MIRROR    debootstrap's mirror (default http://deb.debian.org/debian)
#   TORCH_INDEX_URL  an extra pip index for the torch wheel (default PyTorch's CPU wheels, so that
#                    the base gets the CPU build, not PyPI's CUDA build; empty: pip's settings only)
# Exit status: 0 built; 2 usage, or a missing engine or tool; 75 the stand-in base could not be made
# (no network to the Debian mirror or to pip's index); 1 the image build failed.
set -euo pipefail

say() { echo "build_image_local.sh: $*" >&2; }
die() {
  say "error: $1"
  exit "${2:-2}"
}

[[ $# -eq 1 && -n $1 && ($1 != -* || $1 == --base-only) ]] || { echo "usage: build_image_local.sh TAG | --base-only" >&2; exit 2; }
tag=$1
root=$(cd "$(dirname "$0")/.." && pwd)

command -v docker >/dev/null || die "no docker command: install the Docker engine (apt-get install docker.io) and start dockerd"
docker info >/dev/null 2>&1 ||
  die "no Docker engine answers ('docker info' failed): start dockerd, or use an account allowed to reach it"
torch_pin=$(grep -m 1 -E '^torch==[^ ]+$' "$root/requirements.txt") || die "requirements.txt pins no torch==VERSION"
base=distqa-stand-in-base:torch-${torch_pin#torch==}
# The venv first, as conda's bin/ in pytorch/pytorch. PIP_CERT: this host's CA bundle is copied in
# (a TLS-inspecting proxy's CA, where there is one), and pip inside the build must trust it too.
base_path=/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ca_bundle=/etc/ssl/certs/ca-certificates.crt

work=""
# shellcheck disable=SC2329  # called by the trap below
cleanup() {
  [[ -n $work ]] || return 0
  # debootstrap mounts /proc and /sys in the new root; one it left behind must not be deleted into.
  local mount
  while read -r mount; do umount -l "$mount" 2>/dev/null || true; done < <(awk -v w="$work/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r)
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

# tail_of LOG: its last lines, for a failure message.
tail_of() { tail -n 5 "$1" | sed 's/^/  | /' >&2; }

make_base() {
  command -v debootstrap >/dev/null || die "making the stand-in base $base needs debootstrap (apt-get install debootstrap)"
  ((EUID == 0)) || die "making the stand-in base $base needs root (debootstrap, chroot); later builds reuse it"
  python3 -m pip --version >/dev/null 2>&1 || die "making the stand-in base $base needs pip for python3 on this host (it fetches $torch_pin)"
  work=$(mktemp -d "${TMPDIR:-/tmp}/distqa-base.XXXXXX")
  local rootfs=$work/rootfs
  say "making the stand-in base $base: debootstrap bookworm + $torch_pin (a few minutes, once)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
    "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$work/debootstrap.log" 2>&1 ||
    { tail_of "$work/debootstrap.log"; die "debootstrap failed: no Debian mirror reachable? (DEBIAN_MIRROR)" 75; }
  # This host's pip, with its index and wheel settings, fetches the wheel for the base's Python.
  local index=(--extra-index-url "${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}")
  [[ -n ${index[1]} ]] || index=()
  python3 -m pip download -qq --retries 0 --no-deps --only-binary=:all: --python-version 3.11 \
    --platform "manylinux_2_28_$(uname -m)" "${index[@]}" -d "$rootfs/wheels" "$torch_pin" >"$work/pip.log" 2>&1 ||
    { tail_of "$work/pip.log"; die "pip could not fetch $torch_pin for Python 3.11" 75; }
  cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
  cp "$ca_bundle" "$rootfs$ca_bundle"
  # A clean environment: this host's PIP_* settings name paths that do not exist in there.
  env -i PATH=/usr/bin:/bin PIP_CERT="$ca_bundle" "$(command -v chroot)" "$rootfs" /bin/sh -c \
    'python3 -m venv /opt/conda && /opt/conda/bin/pip install --quiet --no-cache-dir /wheels/torch-*.whl' \
    >"$work/install.log" 2>&1 ||
    { tail_of "$work/install.log"; die "installing $torch_pin into the stand-in base failed (pip's index reachable?)" 75; }
  # Docker writes the container's own resolv.conf at run time; the host's has no place in the image.
  rm -rf "$rootfs/wheels" "$rootfs/etc/resolv.conf" "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" --numeric-owner -c . |
    docker import -c "ENV PATH=$base_path" -c "ENV PIP_CERT=$ca_bundle" -c 'CMD ["/bin/bash"]' - "$base" >/dev/null
  say "made $base"
}

if docker image inspect "$base" >/dev/null 2>&1; then
  say "stand-in base $base: reusing it"
else
  make_base
fi

if [[ $tag == --base-only ]]; then
  say "stand-in base $base ready; no image built (--base-only)"
  exit 0
fi

say "building $root/Dockerfile as $tag"
# --network host: pip inside the build reaches the index the way this host does. Plain progress, so
# that a BuildKit builder prints the steps' output (pip's lines) as the classic builder does.
BUILDKIT_PROGRESS=plain docker build --network host --build-arg BASE_IMAGE="$base" -t "$tag" "$root" ||
  die "the image build failed (its output is above)" 1
say "built $tag on $base: docker run --rm --user \"\$(id -u):\$(id -g)\" -v \"\$PWD/results:/app/results\" $tag"
