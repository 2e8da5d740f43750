"""The LM head screen (CPU): greedy and top-k rows take exact logits from an int8 screen of the head, from the head's own codes or an int8 copy, with a proven error bound."""
