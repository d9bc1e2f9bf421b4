#!/usr/bin/env bash
# kvpool's GPU check: the worker core and embedded pool on synthetic vLLM-shaped KV caches on CUDA.
# Runs on a bare GPU machine (torch and numpy; no network, no vLLM, no install), in about a minute on
# one H200 and at most 220 s (its watchdog dumps stacks and exits 3 before a 4-minute budget):
#   scripts/device_check.sh --out "$OUT/device_check.json"   # JSON written after every phase
# `--dry-run` runs every phase small on the CPU and `--plan-only` checks the GPU plan without
# allocating it; both run in `make test`. Prints the JSON on stdout and PASS or FAIL on stderr;
# exits 0 on PASS, 1 on FAIL, 2 without CUDA, 3 on the watchdog.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m kvpool.benchmarks.device.check "$@"
