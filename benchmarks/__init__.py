"""fastload benchmarks: `make bench` (full) and `make bench-quick`; results in benchmarks/results/."""
