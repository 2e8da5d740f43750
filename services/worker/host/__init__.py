"""The worker process's host: what it sets before torch loads (process_start.py) and the memory
an idle worker hands back (idle_release.py)."""
