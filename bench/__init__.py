"""The benchmark harness: bench/run.py and its helpers (see bench/RESULTS.md)."""
