#!/usr/bin/env bash
# kvpool's GPU check: the worker core and embedded pool on a synthetic vLLM-shaped KV cache on CUDA.
# Runs on a bare GPU machine (torch, numpy, rich, typer, prometheus-client; no network, no vLLM, no
# install): `scripts/device_check.sh`; `--dry-run` is the CPU self-test that `make test` runs.
# Prints a JSON summary on stdout and PASS or FAIL on stderr; exits 0 on PASS, 1 on FAIL.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m kvpool.benchmarks.device_check "$@"
