"""The gateway's metrics (fairserve's own and vLLM-compatible families), latency tracking and request spans."""
