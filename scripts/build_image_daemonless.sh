#!/usr/bin/env bash
# Build the Dockerfile and run its entrypoint where there is no Docker engine (and no Docker Hub):
# buildah, as root, with chroot isolation, on a stand-in for the CUDA PyTorch base image made here:
# Debian bookworm, Python 3.11, and requirements.txt's torch (a CPU wheel where pip finds one) in a
# virtual environment at /opt/conda, whose bin/ comes first on PATH, as in pytorch/pytorch.
# It checks the Dockerfile's own steps (the torch pin kept, the package installed, the unprivileged
# user, the entrypoint training on the CPU), not the real base image.
#   scripts/build_image_daemonless.sh WORKDIR       (WORKDIR: scratch space, several GB)
# Exit status: 0 built and trained; 75 the stand-in base could not be made (no network to the
# Debian mirror or to pip's index); anything else: the image build or its run failed.
set -euo pipefail

usage() { echo "usage: build_image_daemonless.sh WORKDIR" >&2; exit 2; }
[[ $# -eq 1 ]] || usage
work=$1
root=$(cd "$(dirname "$0")/.." && pwd)
for tool in buildah debootstrap; do
  command -v "$tool" > /dev/null || { echo "build_image_daemonless.sh: needs $tool (apt-get install $tool)" >&2; exit 2; }
done
(( EUID == 0 )) || { echo "build_image_daemonless.sh: needs root (debootstrap, chroot)" >&2; exit 2; }

mkdir -p "$work"
work=$(cd "$work" && pwd)
store=(--storage-driver vfs --root "$work/storage" --runroot "$work/run")
torch_pin=$(grep -E '^torch==' "$root/requirements.txt")
base=localhost/distqa-stand-in-base:latest
image=localhost/distqa:daemonless
say() { echo "build_image_daemonless.sh: $*" >&2; }

containers=()
cleanup() {
  for c in "${containers[@]}"; do buildah "${store[@]}" rm "$c" > /dev/null 2>&1 || true; done
}
trap cleanup EXIT

say "stand-in base: debootstrap bookworm + $torch_pin"
ctr=$(buildah "${store[@]}" from scratch)
containers+=("$ctr")
rootfs=$(buildah "${store[@]}" mount "$ctr")
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
  "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$work/debootstrap.log" 2>&1 \
  || { say "debootstrap failed (see $work/debootstrap.log)"; exit 75; }
# The host's pip, with its index and find-links, fetches the wheel; inside, pip trusts what the
# host trusts (a TLS-inspecting proxy's CA, if there is one) and resolves names as the host does.
python3 -m pip download --quiet --no-deps -d "$rootfs/wheels" "$torch_pin" \
  || { say "pip could not fetch $torch_pin"; exit 75; }
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
# A clean environment: the host's PIP_* settings name paths that do not exist in there.
env -i PATH=/usr/bin:/bin PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$(command -v chroot)" "$rootfs" /bin/sh -c \
  'python3 -m venv /opt/conda && /opt/conda/bin/pip install --quiet --no-cache-dir /wheels/torch-*.whl && rm -rf /wheels' \
  || { say "installing torch into the stand-in base failed"; exit 75; }
buildah "${store[@]}" config --env PATH=/opt/conda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$ctr"
buildah "${store[@]}" umount "$ctr" > /dev/null
buildah "${store[@]}" commit --quiet "$ctr" "$base" > /dev/null

say "building $root/Dockerfile on it"
# --format docker keeps SHELL (bash with pipefail), as docker build does.
buildah "${store[@]}" bud --format docker --isolation chroot --network host \
  --build-arg BASE_IMAGE="$base" -t "$image" "$root" > "$work/build.log" 2>&1 \
  || { say "the image build failed (see $work/build.log)"; exit 1; }
buildah "${store[@]}" inspect --type image "$image" > "$work/image.json"

say "running the entrypoint as the image's user"
run=$(buildah "${store[@]}" from "$image")
containers+=("$run")
user=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["Docker"]["config"]["User"])' "$work/image.json")
buildah "${store[@]}" run --isolation chroot --network host --user "$user" "$run" -- \
  /app/scripts/worker.sh --config configs/quickstart.yaml train.max_steps=5 output_dir=results/smoke \
  > "$work/run.log" 2>&1 || { say "the entrypoint failed (see $work/run.log)"; exit 1; }
buildah "${store[@]}" run --isolation chroot --user "$user" "$run" -- \
  sh -c 'id -u; ls /app; ls /app/results/smoke/model' > "$work/inspect.log" 2>&1
say "ok: $image built and trained (logs in $work)"
