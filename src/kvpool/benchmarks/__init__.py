"""`kvpool bench`: each bench measures kvpool against a baseline run in the same process and rounds,
and writes a result file (`benchmarks/results/`) that the figures of docs/measurements.md name. The benches come
in families, one subpackage each, whose `__init__.py` says what it measures and what it may import:

- `measure`: the statistics, the tables and plots, the rounds kept across runs: what every family uses;
- `device`: the GPU check (`python -m kvpool.benchmarks.device.check`);
- `transfer`: save/load throughput through a backend, and the disk tier's;
- `policy`: hit rates of the embedded pool's eviction policies over a trace;
- `per_step`: CPU per engine step of the save path, the whole connector and the lookup, and their scaling;
- `serving`: end to end through real vLLM engines and servers, next to the peers.

Imports between families go one way, down this list: a family imports only families above it
(`serving` imports `per_step` and `policy`; every family `measure`). `suite.py` (`kvpool bench all`)
runs every family's benches; a bench's `*_report.py` (or its family's `report.py`) renders its result.
May import: every part except `ops`, every family, and the peers it measures (vLLM, LMCache), lazily.
"""
