"""What the services read from and write into a model's or an adapter's directory: adapter paths
and PEFT configs, the tokenizer's merges rewritten as strings, atomic whole-file replacement."""
