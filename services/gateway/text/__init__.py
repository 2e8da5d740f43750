"""Text in and out: the model's tokenizer and chat template (no transformers), incremental detokenizing, stop strings, and a reply's tool calls as they stream."""
