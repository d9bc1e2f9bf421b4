"""The worker side, one per engine rank: the save path and the load path over the engine's KV memory.

Saves read one way, stage after stage (`save_path.py`): plan the new chunks with two high-water marks
(`save_plan.py`) → capture them inside the step that computed them (`save_batch.py`) → put them into
the pool, on the sender thread for a remote pool (`sender.py`, `save_put.py`) → retire their ranges.
Loads likewise (`load_path.py`): the chunks of a hit (`save_plan.py`, which holds the request states)
→ read into the engine's blocks (`loader.py`) → failures lower the marks → reported to the engine.
The engine's memory is `layout.py` (rows of every layer, seals from `integrity.py`); device memory
moves through `device_copy.py`, `staging.py` and `cuda_runtime.py`. `worker_core.py` is the facade
the adapter calls; `pool_tracker.py` reports what this rank's pool holds.
May import: `core`, `backends`.
"""
