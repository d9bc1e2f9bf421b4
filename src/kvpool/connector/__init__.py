"""The connector's two roles assembled from the parts, without vLLM.

`roles.py` decides what each role runs (its pool, its lookup transport, where loads and saves run)
from the settings and the plan; `registry.py` finds the in-process roles of an engine by its id.
The adapter translates vLLM's calls into these roles' calls.
May import: `core`, `backends`, `worker`, `scheduler`.
"""
