"""What every bench's figures stand on, bench-neutral: figures over interleaved rounds (`stats.py`: the
rotated order, a median with its 95% interval, ratios paired round by round, verdicts that can fail),
a result as a Markdown table and a PNG plot (`report.py`), and the finished rounds kept across runs so
a later run goes on from there (`checkpoint.py`).
May import: `core` and itself, no other benchmark family (every family imports this one).
"""
