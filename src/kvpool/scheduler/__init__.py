"""The scheduler side: lookups, request trackers and per-step deltas, never blocking the engine loop.

`scheduler_core.py` answers lookups (from the index, or from the pool on a thread) and turns each
step into deltas of what changed; `steps.py` is its per-step policy (lookups answered, loads armed,
preemptions and re-admissions), `load_watch.py` which requests a failed load names; `index.py` holds
what the workers' embedded pools hold, fed by their reports; `remote_events.py` turns a shared pool's
puts into KV events; `chunk_origins.py` and `explain.py` say why a prompt hits where it does.
May import: `core`.
"""
