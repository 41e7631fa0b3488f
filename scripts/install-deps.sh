#!/usr/bin/env bash
# Installs the Debian packages ferry builds and tests with. Idempotent and quiet
# when everything is already there; needs root (or sudo) only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config clang libclang-rt-14-dev ccache
  libgtest-dev libgmock-dev libbenchmark-dev
  libucx-dev ucx-utils
  libhiredis-dev redis-server
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev libxxhash-dev
  libssl-dev libasio-dev
  prometheus-cpp-dev prometheus python3-prometheus-client  # metrics (src/metrics), the server tests scrape with, ferry.Metrics.collector()
  libopenmpi-dev openmpi-bin
  libsimgrid-dev python3-matplotlib  # ferry simulate (src/simulate), its --plot
  iproute2 iptables util-linux  # emulated hosts (scripts/hosts.sh: ip, tc, nsenter; loss)
  python3 python3-dev pybind11-dev python3-numpy python3-torch
  python3-venv python3-pip python3-setuptools python3-wheel dpkg-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
