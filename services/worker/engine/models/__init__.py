"""Model classes of our own, for the checkpoints the direct forward serves without transformers (loader.py says when)."""
