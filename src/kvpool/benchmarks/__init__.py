"""`kvpool bench`: each bench measures kvpool against a baseline run in the same process and rounds,
and writes a result file (`benchmarks/results/`) that the README's figures name. `suite.py` runs them
all; `*_report.py` modules render a result; `device_check.py` is the GPU check
(`python -m kvpool.benchmarks.device_check`). May import: every part except `ops`, and the peers it
measures (vLLM, LMCache), lazily.
"""
