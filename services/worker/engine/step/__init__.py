"""One step: the sequences, planning a step's tokens and blocks, the packed inputs, the forward, attention over the paged cache, isolation between sequences, and the varlen prefill contract."""
