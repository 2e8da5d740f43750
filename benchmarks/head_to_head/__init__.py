"""The head-to-head serving benchmark: one workload, run one system at a time
(fairserve, vLLM's CPU build, llama.cpp's llama-server, transformers serve) on
the same machine and model; tables, JSON and PNG curves. `python -m
benchmarks.head_to_head --help`."""
