"""Adapters from serving engines to the connector's roles: `vllm/` (vLLM's KV connector API).
May import: every part of kvpool below `ops`, `benchmarks` and `testing`, and the engine it adapts.
"""
