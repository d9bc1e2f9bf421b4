"""Test and demo helpers: tiny random models and real vLLM CPU engines and servers (vLLM imported
lazily), a real Mooncake master for tests, a no-op connector, a router's KV-event indexer.
May import: `core`, `backends`.
"""
