"""The pools: one small protocol (`base.py`: exists / put / get_into / remove / stats / healthy, a
status per key, batches as `Rows`) and its implementations: the embedded pool (`memory.py`, LRU with
tail-first eviction; `memory_values.py` the bytes of a batch's values), its disk tier (`disk.py` sealed
files, `disk_file.py` their format and file I/O, `disk_owner.py` one process per directory, `tiered.py`
the two tiers as one pool), the process's named embedded pools (`shared_pools.py`), and Mooncake Store
(`mooncake/`: the client, its error codes, batch routes, circuit breaker, and the pool's own master and
segment-holder processes). `factory.py` builds one by its configured name.
May import: `core` (and a backend's own client library, only inside its package).
"""
