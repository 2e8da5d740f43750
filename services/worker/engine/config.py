"""Engine settings as a plain value; services/worker/settings.py (engine_config_from_env) fills it
from the environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.engine.lora.registry import LoraConfig


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str                     # local Hugging Face directory
    device: str = "auto"               # auto|cpu|cuda|mps; auto = CUDA -> MPS -> CPU
    dtype: str = "auto"                # auto = float32 on CPU/MPS, bfloat16 on CUDA
    block_size: int = 16
    num_blocks: int = 0                # 0 = size from kv_memory_fraction, else 0.5 of free memory (CUDA) / cpu_kv_bytes
    kv_memory_fraction: float = 0.0    # of free device memory (CUDA) or available host memory; 0 = default
    kv_hybrid: bool = True             # sliding-window layers keep their own, smaller cache (sliding_blocks.py)
    sliding_blocks: int = 0            # its blocks; 0 = num_blocks when that is given, else half the byte budget
    enable_prefix_caching: bool = True
    prompt_logits_cache_size: int = 32  # prompts whose last position is kept (identical prompts skip the forward)
    eviction_policy: str = "lru"       # lru | lfu (eviction.py)
    max_model_len: int = 0             # 0 = from the model config (capped at cpu_max_model_len on CPU)
    model_key: str = ""                # mixed into block hashes (use the model name)
    torch_threads: int = 0             # 0 = leave torch's default
    use_cuda_graphs: bool = True       # decode-only steps replay captured CUDA graphs; CPU ignores it
    cuda_graph_max_batch: int = 64     # largest decode batch replayed from a graph; larger ones run eagerly
    cuda_graph_max_context: int = 8192 # longest context replayed from a graph; longer ones run eagerly
    attention_backend: str = "auto"    # prefill chunks: auto (flash-attn on CUDA, native C on CPU) | sdpa | flash_attn | native
    decode_attention: str = "auto"     # CPU float32 decodes: auto (native when it builds and checks) | native | sdpa
    cpu_native_kernels: str = "auto"   # CPU float32: C kernels for norms, gated activations, few-row linears (auto) | off
    host_memory_release_rows: int = 256   # CPU: a step of at least this many rows hands the memory it freed back (0: never)
    cpu_gemm_cache_entries: int = 8    # CPU: GEMM shapes oneDNN's primitive cache and torch's (ideep's) cache each keep at most (0: their own default, 1024)
    cpu_weight_codes: str = "auto"     # CPU float32: weights that are exact codes (dequantized GGUF) decode from them: auto (4-6 bits where they fit, if faster here) | narrow | 8bit | off
    direct_forward: str = "auto"       # CPU: the base model's forward without transformers' module dispatch (auto) | off
    model_impl: str = "auto"           # auto: our own model class where one computes the checkpoint and the direct forward serves | transformers
    kernel_cache_dir: str = ""         # where the native kernel is compiled to; "" = ~/.cache/fairserve/kernels
    cpu_kv_bytes: int = 1 << 30        # KV pool size on CPU/MPS when num_blocks == 0
    cpu_packed_weights: bool = True    # pre-packed linear weights on CPU float32/bfloat16 (faster decode batches)
    cpu_linear_kernel: str = "auto"    # packed kernel: auto (float32: the faster on this CPU) | mkl | onednn
    cpu_compute: str = "float32"       # CPU float32 models: float32 | bfloat16 (the layers' wide GEMMs in bfloat16; lossy)
    cpu_prefill_weights: str = "auto"  # CPU float32 coded linears' wide steps: auto (codes where a pack written from them stands in for oneDNN's) | packs (a float32 pack each) | codes (expanded per step: no float32 copy resident)
    cpu_prefill_gemm: str = "auto"     # the GEMM of those steps from the codes: auto (the native AVX2 one per shape where it gives the library's bits and is faster; the AMX one where it is faster, within a float32 bound) | native | amx | library
    cpu_max_model_len: int = 8192
    lm_head_screen: str = "auto"       # CPU float32 greedy/top-k rows: auto (built in the background, large vocabularies) | on | off
    lm_head_screen_max_rows: int = 0   # screened rows per step at most (0: by the screen's kernel); more take the full LM head
    lm_head_screen_weights: str = "auto"   # what the screen multiplies: auto (a head kept as 8-bit codes: the codes; else an int8 copy) | copy (an int8 copy always)
    lm_head_screen_activations: str = "auto"   # a screen from 8-bit codes rounds hidden states to: auto (the faster kernel, timed at build) | int16 | int8 (AVX-512 VNNI + VBMI)
    lm_head_screen_plane: bool = False   # one-row passes from a 4-bit plane of a coded head's codes first (+half the codes' bytes in memory)
    ngram_min: int = 2                 # speculation: shortest suffix looked up earlier in the sequence
    ngram_max: int = 4                 # speculation: longest suffix looked up
    grammar_tokenizer: str = "first_use"   # structured output's tokenizer: first_use (built when the first constrained sequence registers) | start
    lora: LoraConfig = field(default_factory=LoraConfig)   # LoRA adapters (lora/registry.py); off unless LORA_MODULES or LORA_ROOT


def require_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming `what` when `value` is not one of `choices`."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")
