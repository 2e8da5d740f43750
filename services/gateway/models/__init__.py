"""Which models the gateway serves: the served names and the LoRA adapters' catalog."""
