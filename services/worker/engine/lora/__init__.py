"""LoRA adapters served beside the base model: PEFT loading, residency, the per-step gathered update."""
