#!/usr/bin/env bash
# One-command set-up for a GPU host, in the virtual environment that already holds the CUDA
# build of torch: keeps that torch (never installs or upgrades it; pip gets it as a
# constraint), then installs dsmesh in editable mode with Triton, the Mooncake Transfer Engine
# built for torch's CUDA, FlashInfer at the tested release, and DeepGEMM / DeepEP at the
# release built for that torch where one exists (dsmesh/runtime/gpu_install.py; the version
# table is dsmesh/kernels/libraries.py, docs/GPU.md "Install"). Prints what it installs, why,
# and what it skips.
#
#   bash scripts/setup-gpu.sh                      # install
#   bash scripts/setup-gpu.sh --dry-run            # print the plan and the pip command only
#   bash scripts/setup-gpu.sh -- --no-index --find-links DIR   # extra arguments for pip
#   bash scripts/setup-gpu.sh --no-editable        # dsmesh as a copy (deploy/Dockerfile)
#   bash scripts/setup-gpu.sh --libraries-only     # the GPU libraries without dsmesh
#
# With --dry-run only, DSMESH_TORCH_VERSION and DSMESH_CUDA_VERSION stand in for the
# installed torch (e.g. 2.11.0+cu130 and 13.0), to print the plan for another host.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
dry_run=0
for arg in "$@"; do
  [ "$arg" = "--" ] && break
  [ "$arg" = "--dry-run" ] && dry_run=1
done
# the Debian libraries the Mooncake Transfer Engine links against
if command -v apt-get >/dev/null && ! ldconfig -p | grep -q 'libibverbs.so.1'; then
  if [ "$dry_run" = 1 ]; then
    echo "would run: apt-get install -y libibverbs1 libnuma1"
  else
    apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1
  fi
fi
# this checkout's dsmesh, whatever the environment holds already
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m dsmesh.runtime.gpu_install "$@"
