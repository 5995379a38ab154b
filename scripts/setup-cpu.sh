#!/usr/bin/env bash
# One-command set-up for a CPU machine (and CI): the Debian libraries the Mooncake Transfer
# Engine links against, the local CPU build of torch (an unpinned torch would pull a
# multi-GB CUDA build), then dsmesh in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null && ! ldconfig -p | grep -q 'libibverbs.so.1'; then
  apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1
fi
pip install torch==2.13.0 -e '.[test]'
