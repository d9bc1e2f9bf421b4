"""What operators run: the `kvpool` command (`cli.py`: demo, inspect, explain, master, segment; its
`bench` commands in `bench_cli.py`; what they share in `cli_common.py`), the demo, and `inspect` of a
master or a server. May import: every part of kvpool.
"""
