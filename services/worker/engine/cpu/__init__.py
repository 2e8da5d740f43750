"""The engine's CPU speed-ups: pre-packed and 8-bit-coded linears, the C kernels in
`native/` (built once per machine by native_build.py), fused norms and gated MLPs,
the direct forward and its one-call C decode layers, the LM head screen, and the
host allocator tuning. Each one is optional: the engine core runs without them.
"""
