#!/usr/bin/env bash
# Installs the Debian packages the build needs (when run as root and they are
# missing), then configures and builds into build/ (and build-asan/ when asked).
# usage: scripts/setup.sh [asan]
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
# OpenBLAS, pthread build (its headers are where CMakeLists.txt looks first);
# the CPU backend turns its threads off and threads with OpenMP (gcc's libgomp).
for p in cmake make gcc libopenblas-pthread-dev pkg-config; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup: missing packages ${need[*]} (run as root to install them)" >&2
    exit 1
  fi
fi

jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$jobs"
if [ "${1:-}" = asan ]; then
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMST_SANITIZE=ON -DMST_CUDA=OFF >/dev/null
  cmake --build build-asan -j"$jobs"
fi
