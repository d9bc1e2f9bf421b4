"""Transfer throughput (`kvpool bench transfer`): save/load GB/s of a batch of chunks through a kvpool
backend, the embedded pool or Mooncake, next to raw Mooncake and a plain memcpy of the same bytes
(`backends.py`: the bench; `batch.py`: the batch and every path that moves it; `rounds.py`: the timed
rounds; `report.py`: its targets and table), and the embedded pool's disk tier next to the disk's own
sequential I/O (`disk.py`, `--backend disk`).
May import: `core`, `backends`, `worker`, `benchmarks.measure` and itself.
"""
