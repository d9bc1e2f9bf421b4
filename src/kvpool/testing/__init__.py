"""Test and demo helpers: tiny random models and real vLLM CPU engines (imports vLLM lazily)."""
