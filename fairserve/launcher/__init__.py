"""Running the whole stack on one machine: `fairserve run` and `make run` (run_stack.py), the
processes and their ports (stack.py), restarts (supervisor.py) and generated tokens
(local_tokens.py)."""
