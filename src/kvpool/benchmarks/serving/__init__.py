"""End to end through real vLLM engines and servers, next to the connectors users would otherwise pick:
`serve.py` (behind vLLM's OpenAI server, measured by vLLM's own serving client: its workload in
`serve_workload.py`, the systems in `serve_systems.py` and `lmcache_peer.py`, their servers in
`servers.py`, a round's runs and hit probe in `serve_client.py`, its verdicts in `serve_report.py`),
`trace.py` (the Mooncake conversation trace replayed on those servers, `trace_report.py`), `shared.py`
(two servers sharing one pool), `serve_overhead.py` (what kvpool costs a request), `hang.py` (a hung
Mooncake master) and `breakdown*.py` (where a request's time goes, in an in-process engine).
May import: every part except `ops`, `benchmarks.measure`, `benchmarks.per_step` (vLLM's Mooncake store
config), `benchmarks.policy` (the trace's path) and itself; vLLM and LMCache lazily.
"""
