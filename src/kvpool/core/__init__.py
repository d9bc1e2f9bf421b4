"""The core: what a chunk is and where it goes, as plain data, with no engine, pool or thread.

Keys (engine block hashes → chunk keys under a layout fingerprint), masks (one class per attention
kind: which chunks are stored, asked about, loaded), specs (engine KV-cache specs → kinds, or a
refusal by name), chunks (a rank's chunks in a token range, TP-striped), the plan both roles build
from an engine's plain facts, and the vocabulary every other part shares: settings (`config.py`,
`mooncake_options.py`), errors, sizes, the per-step metadata and the pool reports that travel
between the roles, buffer views.
May import: nothing of kvpool outside `core` (numpy and the standard library only; torch lazily).
"""
