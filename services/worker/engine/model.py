"""The model an engine runs, prepared in one call: loaded (or handed in), placed on
its device and dtype, switched to the paged attention function, given the device's
speed-ups and the LM head screen that the engine's accelerators plug in
(accelerators.py; on CPU cpu/speedups.py and cpu/screen_loader.py).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.worker.engine.accelerators import Accelerators, CheckpointPages, HeadScreenLoader, Speedups
from services.worker.engine.step.attention import ATTENTION_NAME, register_attention
from services.worker.engine.config import EngineConfig, require_choice
from services.worker.engine.device import resolve_device, resolve_dtype
from services.worker.engine.lora.layers import LoraStep, wrap_projections
from services.worker.engine.models.loader import MODEL_IMPLS, load_own_model, own_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class PreparedModel:
    model: torch.nn.Module
    model_config: PretrainedConfig      # the text decoder's config (Gemma 4 wraps it in a multimodal one;
                                        # models/text_config.py's TextConfig for our own classes)
    base: torch.nn.Module               # the text decoder without its LM head
    device: torch.device
    dtype: torch.dtype
    kernel_cache_dir: Path | None       # where compiled kernels are kept (None: no speed-ups plugged in)
    speedups: Speedups
    screen: HeadScreenLoader
    softcap: float | None               # final logit soft-capping, if the model has it
    mask_by_type: dict | None           # the attention mask argument: a None per layer type, or None
    eos_token_ids: list[int]
    lora_step: LoraStep | None = None   # with LoRA on: the step's adapter rows, read by every projection
    lora_shapes: dict[str, tuple[int, int]] | None = None   # each wrapped projection: (in, out)

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.speedups.lm_head


def prepare_model(config: EngineConfig, model: torch.nn.Module | None = None,
                  accelerators: Accelerators | None = None) -> PreparedModel:
    """`model` (else the checkpoint in config.model_dir) ready for the engine's steps, with
    the speed-ups `accelerators` plug in (none by default)."""
    accelerators = accelerators if accelerators is not None else Accelerators()
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if device.type == "cpu":
        accelerators.bound_gemm_caches(config.cpu_gemm_cache_entries)
    own = model is None and _loads_own_model(config, device, accelerators)
    pages = None
    if model is None:
        # On CPU the weight matrices stay views of the checkpoint until the speed-ups have read
        # them (weight codes, packs): only what the model still holds then is copied out.
        model, pages = _load_model(config.model_dir, dtype, accelerators.checkpoint_page_release, own,
                                   defer_matrices=device.type == "cpu")
    model.to(device=device, dtype=dtype).eval()
    if not own:
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
    # Multimodal checkpoints (Gemma 4) wrap the text decoder; only the text path runs here.
    model_config = model.config.get_text_config()
    if getattr(model_config, "attn_logit_softcapping", None):
        raise ValueError("attention logit softcapping is not supported by the paged attention path")
    base = model.base_model
    base = getattr(base, "language_model", base)
    kernel_cache_dir = Path(config.kernel_cache_dir) if config.kernel_cache_dir else accelerators.default_kernel_dir()
    speedups = accelerators.apply_speedups(base, model.get_output_embeddings(), config, device, dtype,
                                           kernel_cache_dir, pages.release if pages is not None else None)
    if own and speedups.direct is None:
        raise RuntimeError(f"{config.model_dir}: our model class runs only through the direct forward, which "
                           "does not serve here: set MODEL_IMPL=transformers")
    softcap = getattr(model_config, "final_logit_softcapping", None)
    lora_step, lora_shapes = _serve_loras(config, model, speedups)
    # The tied embedding and LM head from the head's codes: the float32 matrix only builds the screen.
    head_weight = accelerators.serve_tied_weight_from_codes(model, speedups.lm_head)
    if pages is not None:
        _own_weights(model, pages, keep_mapped=lambda tensor: not pages.holds(tensor))
    if device.type == "cpu":
        gc.collect()                  # replaced modules sit in reference cycles, holding weights
        accelerators.release_freed_host_memory()   # what loading and the speed-ups freed (cpu/host_memory.py)
        # Only now: loading's temporaries went back to the system as they were freed, so the steps'
        # buffers do not land all over a heap they left full of holes (cpu/host_memory.py).
        accelerators.keep_freed_host_memory()
        accelerators.release_library_pages()       # the libraries' start-up code (cpu/library_pages.py)
    screen = accelerators.lm_head_screen(config, softcap, kernel_cache_dir, speedups.native_kernels)
    screen.start(model.get_output_embeddings(), device, dtype, head_weight,
                 speedups.lm_head.coded if head_weight is not None else None)
    del head_weight
    layer_types = getattr(model_config, "layer_types", None)
    return PreparedModel(
        model=model, model_config=model_config, base=base, device=device, dtype=dtype,
        kernel_cache_dir=kernel_cache_dir, speedups=speedups, screen=screen, softcap=softcap,
        mask_by_type={kind: None for kind in set(layer_types)} if layer_types else None,
        eos_token_ids=_eos_token_ids(model), lora_step=lora_step, lora_shapes=lora_shapes)


def _serve_loras(config: EngineConfig, model: torch.nn.Module, speedups: Speedups
                 ) -> tuple[LoraStep | None, dict[str, tuple[int, int]] | None]:
    """With LoRA on (LORA_MODULES or LORA_ROOT), every attention and MLP projection wrapped, after
    the speed-ups, around what they made of it (lora/layers.py); the direct forward re-reads them.
    The C decode layers keep the unwrapped projections: they serve steps without adapter rows."""
    if not config.lora.enabled:
        return None, None
    step = LoraStep()
    shapes = wrap_projections(model, step)
    if speedups.direct is not None:
        speedups.direct.serve_loras(step)
    return step, shapes


def _loads_own_model(config: EngineConfig, device: torch.device, accelerators: Accelerators) -> bool:
    """MODEL_IMPL=auto, a checkpoint one of our classes computes (models/loader.py) and an engine
    whose speed-ups run the direct forward: that forward is the only one our classes have."""
    require_choice("MODEL_IMPL", config.model_impl, MODEL_IMPLS)
    return (config.model_impl == "auto" and accelerators.runs_direct_forward(config, device)
            and own_model_class(config.model_dir) is not None)


def _load_model(model_dir: str, dtype: torch.dtype, page_release: Callable[[], CheckpointPages], own: bool,
                defer_matrices: bool = False) -> tuple[torch.nn.Module, CheckpointPages]:
    """The checkpoint's model, its weights copied out of the file's mapping, and the mapping's
    pages (`page_release`, made once loaded). `defer_matrices`: the weight matrices stay views
    of the mapping (prepare_model copies what the speed-ups leave of them)."""
    if own:
        model = load_own_model(model_dir, dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    pages = page_release()
    _own_weights(model, pages, keep_mapped=(lambda tensor: tensor.dim() == 2 and pages.holds(tensor))
                 if defer_matrices else _copy_all)
    return model, pages


def _copy_all(tensor: torch.Tensor) -> bool:
    return False


def _own_weights(model: torch.nn.Module, release: Callable[[int, int], object],
                 keep_mapped: Callable[[torch.Tensor], bool] = _copy_all) -> None:
    """Weights loaded from safetensors are views of the file's memory mapping, and
    every page read stays resident as long as one of them lives. Copying each into
    memory of its own lets the mapping go, so that the weights the speed-ups replace
    (by packs or codes) are really let go; `release` lets each copied weight's mapped
    pages go at once, so that the checkpoint is not resident twice while it is copied.
    Those `keep_mapped` names are left as they are: on CPU the weight matrices wait for the
    speed-ups, which read most of them once (into weight codes; their pages go as they are
    read, `after_read`) and keep no float32 copy, so the default model's worker never holds its
    1.07 GB of float32 weights in memory of its own while it starts (at 64 blocks 1.9 -> 0.7 GB
    at most; docs/engine/cpu-forward.md)."""
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) in seen or tensor.device.type != "cpu":
                continue
            seen.add(id(tensor))
            if keep_mapped(tensor):
                continue
            loaded = tensor.data
            tensor.data = loaded.clone()
            release(loaded.data_ptr(), loaded.numel() * loaded.element_size())


def _eos_token_ids(model: torch.nn.Module) -> list[int]:
    generation = getattr(model, "generation_config", None)
    value = getattr(generation, "eos_token_id", None) if generation is not None else None
    if value is None:
        value = getattr(model.config.get_text_config(), "eos_token_id", None)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
