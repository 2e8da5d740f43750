"""From logits to tokens: the sampler, grammar masks for structured output, n-gram speculation, cached prompt logits and prompt logprobs."""
