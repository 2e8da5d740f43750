"""Where a concurrency-32 W1 step's time goes: `python -m benchmarks.step_profile` (see __main__.py)."""
