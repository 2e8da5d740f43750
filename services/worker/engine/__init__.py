"""The worker's inference engine: paged KV pool, packed batches, sampling.

A pure library (no gRPC, no protobuf) so it can be tested and benchmarked on
its own; services/worker/server.py puts the transport on top of it.

The core (the step: sequences, planning, the forward, sampling, the KV pool) is
at this level; the device speed-ups are apart, in cpu/ and cuda/, which import the
core and never the reverse: they are plugged in from outside (accelerators.py states
how; services/worker/wiring.py plugs them in for the worker, its tests and benchmarks).

Each name has one address: import it from the module that defines it (Engine from
engine.py, EngineConfig from config.py, the step contract from common/step.py).
"""
