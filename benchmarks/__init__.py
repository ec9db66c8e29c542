"""fastload benchmarks: `make bench` (full) and `make bench-quick`.

Results go to benchmarks/results/.
"""
