"""The device check (`python -m kvpool.benchmarks.device.check`, run by `scripts/device_check.sh`):
kvpool's worker core and embedded pool on synthetic vLLM-shaped paged KV caches on CUDA. Its phases
(`phases.py`): byte-exact save -> load round trips, no host wait on the engine's thread, save and load
bandwidth against raw pinned copies, overlap with the engine's forward passes. `plan.py` sizes every
phase for the GPU and the CPU dry run, `cache.py` builds the caches vLLM would allocate, `rig.py` the
layout, pool and worker over them, and `check.py` runs the phases, each in a process of its own on a GPU.
May import: `core`, `backends`, `worker`, `benchmarks.measure` and itself; never vLLM or Mooncake (a
lent GPU machine has torch and numpy only).
"""
