"""Load simulator: many simulated users drive the gateway's OpenAI-compatible API
with weighted prompts and jittered think times (closed loop), or requests arrive
at a fixed Poisson rate (open loop, swept over rates for throughput-vs-latency
curves). `python -m loadsim --help`."""
