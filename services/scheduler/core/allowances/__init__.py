"""What a decode may take beyond its one token in a step: drafts to verify (speculation) and further runs (decode_steps)."""
