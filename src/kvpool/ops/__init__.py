"""What operators run: the `kvpool` command (`cli.py`: demo, bench, inspect, explain, master,
segment), the demo, and `inspect` of a master or a server.
May import: every part of kvpool.
"""
