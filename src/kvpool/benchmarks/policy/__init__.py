"""Hit rates of the embedded pool's eviction policies (`kvpool bench trace-hits`), with no engine and no
server: a trace in the Mooncake format replayed through the pool under each policy, beside plain LRU,
Belady's MIN and no eviction, alone, behind an engine's prefix cache and over the disk tier
(`trace_replay.py`); the bench and its verdicts (`trace_hits.py`, `trace_hits_report.py`); and the reuse
the policies' rules rest on, with docs/eviction-policy.md's generated parts (`trace_reuse.py`).
May import: `core`, `backends`, `benchmarks.measure` and itself.
"""
