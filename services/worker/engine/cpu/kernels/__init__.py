"""The C kernels' Python side: building them once per machine (native/ holds the sources) and calling them for decode and prefill attention, the decode layers, LoRA and the element-wise passes."""
