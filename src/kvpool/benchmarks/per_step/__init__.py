"""CPU per engine step of kvpool's hot paths, in one process on real objects, no server: the save path
next to vLLM's own MooncakeStoreConnector save path (`store_path*.py`), the whole connector, both
roles, on vLLM's scheduler-side objects (`connector_step*.py`; `vllm_workload.py` drives vLLM's
objects step by step, `vllm_store_reference.py` runs vLLM's connector as the reference), the lookup on
the scheduler's thread (`lookup.py`), and how they scale with concurrency and the pool at capacity
(`scale.py`, `scale_pool.py`).
May import: every part except `ops`, `benchmarks.measure` and itself; vLLM lazily.
"""
