"""A tied embedding and LM head served from the head's weight codes alone.

Gemma's embedding is its LM head (262k x 640: 671 MB in float32). Once the head's
weight is exact 8-bit codes (weight_codes.py), every reader of the float32 matrix
can read the codes instead, bit for bit: the embedding looks its rows up from them
(`CodedEmbedding`), the LM head's few-row steps already run from them and its wide
steps (prompt logprobs) multiply tiles expanded from them (cpu_linear.py), and
the LM head screen takes its exact logits from rows expanded from them
(lm_head_screen.py). The float32 matrix then lives only until the screen has been
built from it. Where the codes' scales are half floats and their offsets byte zeros
exactly (a Q8_0 head's), they are kept so (weight_codes.py's half form): 15 MB instead
of 42 on the default model, and the screen's half-scale kernel reads them at every row
count.
"""

from __future__ import annotations

import logging
import sys

import torch

from services.worker.engine.cpu.linear.cpu_linear import PackedLinear
from services.worker.engine.cpu.linear.weight_codes import CodedWeight
from services.worker.engine.models.gemma3_text import Gemma3TextScaledWordEmbedding

log = logging.getLogger(__name__)


class CodedEmbedding(torch.nn.Module):
    """An embedding (plain, or Gemma's scaled one) whose rows come from weight codes."""

    def __init__(self, embedding: torch.nn.Embedding, coded: CodedWeight) -> None:
        super().__init__()
        self.coded = coded
        self.num_embeddings, self.embedding_dim = coded.out_features, coded.in_features
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.coded.rows(input_ids).view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:     # as Gemma's embedding: lookup, then the scale
            rows = rows * self.embed_scale.to(rows.dtype)
        return rows


def serve_tied_weight_from_codes(model: torch.nn.Module, lm_head: torch.nn.Module) -> torch.Tensor | None:
    """When the LM head is coded and is the input embedding's own weight, moves both to
    the codes and drops every module's reference to the float32 matrix; returns it (for
    the screen's build, after which nothing holds it), else None and nothing changes."""
    embedding = model.get_input_embeddings()
    original_head = model.get_output_embeddings()
    if (not isinstance(lm_head, PackedLinear) or lm_head.coded is None or lm_head.packed is not None
            or not isinstance(embedding, torch.nn.Embedding) or type(embedding).forward not in _lookups()
            or embedding.max_norm is not None
            or original_head is None or embedding.weight is not lm_head.weight
            or getattr(original_head, "weight", None) is not lm_head.weight):
        return None
    weight = lm_head.weight.detach()
    half = lm_head.keep_codes_in_half_form()
    model.set_input_embeddings(CodedEmbedding(embedding, lm_head.coded))
    original_head.weight = None
    lm_head.serve_all_rows_from_codes()
    log.info("tied embedding and LM head served from the head's codes%s (%.0f MB of float32 let go "
             "once the screen is built)", ", their scales as half floats" if half else "",
             weight.numel() * weight.element_size() / 1e6)
    return weight


def _lookups() -> tuple[object, ...]:
    """Embedding classes whose forward is a lookup, times a scale at most: torch's, Gemma 3's
    of our own model class and, where a model loaded it already, transformers' (not imported
    here: our own classes never load transformers' modelling stack)."""
    forwards: list[object] = [torch.nn.Embedding.forward, Gemma3TextScaledWordEmbedding.forward]
    theirs = sys.modules.get("transformers.models.gemma3.modeling_gemma3")
    if theirs is not None:
        forwards.append(theirs.Gemma3TextScaledWordEmbedding.forward)
    return tuple(forwards)


