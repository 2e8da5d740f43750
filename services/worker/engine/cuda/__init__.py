"""The engine's CUDA paths: fused varlen prefill attention (flash-attn, when
installed) and decode steps replayed from captured CUDA graphs."""
