"""The worker's settings.

One field per environment variable (the name in capitals): its type, default, bounds and meaning.
`WorkerSettings` builds the running settings from it; `fairserve worker --help`, `fairserve config`
and docs/config.md are generated from it (common/settings/schema.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.settings.shared import (
    InternalAuthFields, WorkerTokenFields, TracingFields, SchedulerAddrFields,
    KvcacheAddrFields, ModelFields, ModelKeyFields, LoraFields, DrainFields, EventLoopFields,
)


DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lfu")                      # services/worker/engine/kv/eviction.py
ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn", "native")   # services/worker/wiring.py
CPU_LINEAR_KERNELS = ("auto", "mkl", "onednn")          # services/worker/engine/cpu/linear/cpu_linear.py
LM_HEAD_SCREEN_MODES = ("auto", "on", "off")            # services/worker/engine/cpu/screen/lm_head_screen.py
LM_HEAD_SCREEN_WEIGHTS = ("auto", "copy")               # services/worker/engine/cpu/screen/screen_loader.py
LM_HEAD_SCREEN_ACTIVATIONS = ("auto", "int16", "int8")  # services/worker/engine/cpu/screen/codes_screen_int8.py
DECODE_ATTENTION_MODES = ("auto", "native", "sdpa")     # services/worker/engine/cpu/kernels/native_decode.py
CPU_NATIVE_KERNELS_MODES = ("auto", "off")              # services/worker/engine/cpu/kernels/native_ops.py
DIRECT_FORWARD_MODES = ("auto", "off")                  # services/worker/engine/cpu/direct_forward.py
MODEL_IMPLS = ("auto", "transformers")                  # services/worker/engine/models/loader.py
CPU_WEIGHT_CODES_MODES = ("auto", "narrow", "8bit", "off")  # services/worker/engine/cpu/linear/weight_codes.py
CPU_COMPUTE_MODES = ("float32", "bfloat16")             # services/worker/engine/cpu/linear/bf16_compute.py
CPU_PREFILL_WEIGHTS_MODES = ("auto", "packs", "codes")  # services/worker/engine/cpu/linear/coded_wide.py
CPU_PREFILL_GEMM_MODES = ("auto", "native", "amx", "library")  # services/worker/engine/cpu/linear/prefill_gemm.py
GRAMMAR_TOKENIZER_MODES = ("first_use", "start")         # services/worker/engine/sampling/grammar.py
CPU_THREAD_POLICIES = ("adaptive", "fixed")              # services/worker/engine/cpu/thread_governor.py


class WorkerSchema(
        InternalAuthFields, WorkerTokenFields, TracingFields, SchedulerAddrFields,
        KvcacheAddrFields, ModelFields, ModelKeyFields, LoraFields, DrainFields, EventLoopFields,
):
    service: ClassVar[str] = "worker"
    advanced: ClassVar[frozenset[str]] = frozenset({
        "event_loop",
        "kv_cache_hybrid",
        "kv_cache_sliding_blocks",
        "prompt_logits_cache_size",
        "torch_threads",
        "use_cuda_graphs",
        "cuda_graph_max_batch",
        "cuda_graph_max_context",
        "attention_backend",
        "decode_attention",
        "cpu_native_kernels",
        "direct_forward",
        "model_impl",
        "cpu_gemm_cache_entries",
        "cpu_weight_codes",
        "cpu_linear_kernel",
        "cpu_compute",
        "cpu_prefill_weights",
        "cpu_prefill_gemm",
        "cpu_thread_policy",
        "host_memory_idle_release_s",
        "host_memory_quiet_release_s",
        "host_memory_release_rows",
        "lm_head_screen",
        "lm_head_screen_max_rows",
        "lm_head_screen_weights",
        "lm_head_screen_activations",
        "lm_head_screen_plane",
        "speculative_ngram_min",
        "speculative_ngram_max",
        "grammar_tokenizer",
        "worker_heartbeat_interval_s",
        "kv_publish_interval_s",
        "scheduler_shards",
        "scheduler_shard_rebalance_s",
    })
    secrets: ClassVar[frozenset[str]] = InternalAuthFields.secrets | WorkerTokenFields.secrets
    worker_host: str = Field('127.0.0.1',
        description=(
            "the worker's gRPC listen address"
        ))
    device: Literal[DEVICES] = Field('auto',
        description=(
            '`auto` (CUDA → MPS → CPU), `cpu`, `cuda`, `mps`'
        ))
    dtype: Literal[DTYPES] = Field('auto',
        description=(
            'float32 on CPU, bfloat16 on CUDA'
        ))
    kv_cache_block_size: int = Field(16, ge=1, le=1024,
        description=(
            'tokens per KV block'
        ))
    kv_cache_num_blocks: int = Field(0, ge=0,
        description=(
            "blocks in each worker's pool (the full-attention layers' cache)"
        ))
    kv_cache_memory_fraction: float = Field(0.0, ge=0.0, le=0.95,
        description=(
            "when blocks is 0: fraction of the free GPU memory (CUDA; `0` means 0.5) or of the host's"
            ' available memory (CPU/MPS; `0` means a fixed 1 GiB) for the KV pool, measured after the'
            ' weights load'
        ))
    kv_cache_hybrid: bool = Field(True,
        description=(
            'a model mixing full-attention and sliding-window layers (Gemma 3) keeps the sliding '
            "layers' K/V in a second, smaller cache that holds only the blocks some window still "
            'covers; `false`: every layer caches every token'
        ))
    kv_cache_sliding_blocks: int = Field(0, ge=0,
        description=(
            'blocks of that sliding cache: `0` gives as many as `KV_CACHE_NUM_BLOCKS` when that is '
            "set, else half of the byte budget; at least one window's blocks plus two"
        ))
    eviction_policy: Literal[EVICTION_POLICIES] = Field('lru',
        description=(
            'which cached prefix block is evicted first: `lru` (least recently freed) or `lfu` '
            '(fewest reuses, then least recently freed: a reused system prompt survives floods of '
            'one-off prompts)'
        ))
    enable_prefix_caching: bool = Field(True,
        description=(
            'reuse cached prefix blocks'
        ))
    prompt_logits_cache_size: int = Field(32, ge=0, le=100_000,
        description=(
            'prompts whose last position is kept, so an identical prompt with its K/V still cached '
            'skips the forward: its final hidden state (the logits are computed from it) and the '
            'rows of logits drawn from it (a screened row serves the same kind of draw again; a '
            'full one, 1 MiB on Gemma 3, any draw); `0` disables'
        ))
    torch_threads: int = Field(0, ge=0,
        description=(
            "intra-op threads; `0`: on CPU the CPUs the worker may run on, no more than its cgroup "
            "quota's whole CPUs (Kubernetes' CPU limit), elsewhere torch's default"
        ))
    use_cuda_graphs: bool = Field(True,
        description=(
            'on CUDA, decode-only steps replay CUDA graphs captured per (batch, context) bucket; a '
            'capture that fails or does not reproduce the eager forward turns them off; CPU and MPS '
            'ignore it'
        ))
    cuda_graph_max_batch: int = Field(64, ge=1, le=1024,
        description=(
            'largest decode batch replayed from a graph; larger decode steps run eagerly'
        ))
    cuda_graph_max_context: int = Field(8192, ge=1,
        description=(
            'longest context (capped at `MAX_MODEL_LEN`) replayed from a graph; a graph gathers its '
            'whole context bucket for every row, so longer contexts run eagerly'
        ))
    attention_backend: Literal[ATTENTION_BACKENDS] = Field('auto',
        description=(
            "prefill attention: `auto` runs all of a step's prefill chunks in one fused call per "
            'layer: on CPU in float32 a small C kernel compiled once per machine like '
            "`DECODE_ATTENTION`'s (causal tiles skipped above the diagonal, no mask built; about half"
            ' the time of SDPA per chunk on W1-like steps) when it builds and passes its start-up '
            'check, on CUDA in float16/bfloat16 `flash_attn_varlen_func` when the `flash-attn` '
            'package is installed; else SDPA per chunk. `sdpa` never uses either; `native` and '
            '`flash_attn` refuse to start without theirs'
        ))
    decode_attention: Literal[DECODE_ATTENTION_MODES] = Field('auto',
        description=(
            'decode attention on CPU in float32: `native` reads K/V through the block tables in a '
            'small C kernel compiled once per machine with the system `cc` (no gathered copy of the '
            "context; cached in `~/.cache/fairserve/kernels`), `sdpa` gathers each decode's context "
            'and calls SDPA, `auto` uses `native` when it builds and passes its start-up check, else '
            '`sdpa` with a warning'
        ))
    cpu_native_kernels: Literal[CPU_NATIVE_KERNELS_MODES] = Field('auto',
        description=(
            "on CPU in float32, small C kernels compiled like `DECODE_ATTENTION`'s: linear layers and"
            ' the LM head for steps of at most 8 rows (decode: the weight streamed once, 13-20 % off '
            "a decode step on the default model), each RMSNorm, and each gated MLP's activation × up "
            '(GELU-tanh or SiLU; ~5 % off a 512-token prefill step); the norms and MLPs only where a '
            "probe at start agrees with torch to float32 rounding; and the LM head screen's int8 × "
            "int16 kernel. `off` keeps torch's and the packed BLAS kernels, and fbgemm's op for the "
            'screen (`DECODE_ATTENTION` has its own switch)'
        ))
    direct_forward: Literal[DIRECT_FORWARD_MODES] = Field('auto',
        description=(
            "on CPU, the base model runs from its own modules without transformers' per-module "
            "dispatch, each layer's RoPE as one C pass in float32 (Gemma 3, Llama, Qwen 2, Qwen 3 "
            "layers; other models keep transformers' forward): ~2 ms off a decode step and ~8 % off a"
            ' 512-token prefill step on the default model, the same tokens (`docs/engine.md`); where '
            'every piece of a Gemma 3 layer is a C kernel (weight codes, native norms, RoPE and '
            'decode attention), decode-only steps of up to 32 rows run all layers in one C call with '
            'bitwise the same hidden states (~10 ms off a step of 8 sequences), and so do steps of '
            "at most 32 rows with prefill chunks, their attention the native prefill kernel's (a cached "
            "prompt's new tokens: ~4.5 ms off its step). `off` runs transformers' forward"
        ))
    model_impl: Literal[MODEL_IMPLS] = Field('auto',
        description=(
            "which model classes hold the checkpoint: `auto` loads a Gemma 3 text checkpoint into "
            "our own classes where the direct forward serves it (CPU, `DIRECT_FORWARD=auto`), the "
            "same weights and the same tokens, without importing transformers' modelling stack "
            "(~120 MB less resident in the worker, `docs/engine/cpu-forward.md`); every other "
            "checkpoint, device or setting loads transformers' class. `transformers` always loads "
            "transformers' class"
        ))
    cpu_gemm_cache_entries: int = Field(8, ge=0, le=65536,
        description=(
            "on CPU, the GEMM shapes oneDNN's primitive cache and torch's own GEMM cache each keep at"
            " most (the libraries' `ONEDNN_PRIMITIVE_CACHE_CAPACITY` and `LRU_CACHE_CAPACITY`, which "
            'win where set). Every prefill step of a new row count adds ~6 MB on the default model, '
            "so with the libraries' default of 1,024 entries a long-running worker grew by hundreds "
            'of MB. The default keeps one row count of up to eight weight shapes (a decoder has at most '
            'five); fewer than a model has makes every GEMM of a step create its primitive again. `0` '
            "keeps the libraries' default (`docs/engine/cpu-forward.md`)"
        ))
    cpu_weight_codes: Literal[CPU_WEIGHT_CODES_MODES] = Field('auto',
        description=(
            'on CPU in float32, linear weights (and the LM head) that are exact 8-bit codes, as a '
            "dequantized GGUF checkpoint's are (every block of 16 or 32 inputs is `scale * code + "
            'offset` bit for bit, checked at start), run steps of at most 32 rows from the codes: the'
            ' same float32 weights, about a third of the bytes to read. `narrow` keeps codes that fit'
            ' in 4, 5 or 6 bits (GGUF Q4_K, Q5_0, Q6_K blocks) at that width, checked at start to '
            'unpack to the same codes (on the default model all linears but the 9 Q8_0 `v_proj` and '
            "the LM head: 128 → 90 MB of layer codes), with the 8-bit path's outputs bit for bit; "
            '`auto` does so where timing the model\'s own linears at start (both widths, 1 and 32 rows)'
            ' finds narrow codes faster at 1 row and not slower at 32 (on a 2-core AMD EPYC Zen 5: '
            '1.28x and 1.03x, kept); `8bit` keeps a byte a code everywhere. On the '
            'default model all 127 linears qualify (about 2 s at start, ~0.7 GB more resident memory '
            'with the codes and the prefill packs); a decode step runs 1.6x faster at batch 1, 1.45x '
            'at 8, 1.2x at 32 (`docs/engine.md`). Other weights keep their kernels; `off` never uses '
            'the codes (`CPU_NATIVE_KERNELS=off` neither)'
        ))
    cpu_linear_kernel: Literal[CPU_LINEAR_KERNELS] = Field('auto',
        description=(
            'packed kernel for the linear layers and LM head on CPU: `auto` takes, for float32, '
            'whichever of MKL and oneDNN runs a short calibration faster on this CPU at start (MKL on'
            " Intel Xeons, oneDNN on AMD EPYC, where MKL's few-row sgemm is 2-2.4x slower), and "
            'oneDNN for bfloat16; `mkl` or `onednn` force one (the worker refuses to start if it has '
            'no packed form for the dtype on this CPU); with `auto`, linears whose few-row steps run '
            'from weight codes (`CPU_WEIGHT_CODES`) are repacked with whichever kernel a second '
            'calibration finds faster on a 256-row prefill chunk (MKL on the Xeon: ~8 % off a prefill'
            ' step); ignored off CPU'
        ))
    cpu_compute: Literal[CPU_COMPUTE_MODES] = Field('float32',
        description=(
            "`bfloat16` (opt-in, lossy) runs the decoder layers' GEMMs of wide steps (prefill chunks,"
            ' and decode batches, from the row count at which it measured faster at start than the '
            'float32 path; where it is not faster even at a 256-row chunk the layers stay float32 '
            'and a warning says so) in '
            'bfloat16 on oneDNN packs, with float32 inputs rounded and outputs widened back; norms, '
            'attention, the KV cache, the LM head and sampling stay float32, and steps of fewer rows '
            'keep their float32 path bit for bit. Coded layers then drop their float32 prefill packs '
            '(the bfloat16 packs take half the bytes). The worker refuses to start with `bfloat16` on'
            ' a CPU without AVX512-BF16 / AMX-BF16 or for a model that is not float32 on CPU. Quality'
            ' and speed against float32: `make bench-bf16` (`docs/benchmarks.md`)'
        ))
    cpu_prefill_weights: Literal[CPU_PREFILL_WEIGHTS_MODES] = Field('auto',
        description=(
            'on CPU in float32, what the coded linears (`CPU_WEIGHT_CODES`) multiply for steps wider '
            "than 32 rows (prefill chunks): `auto` expands each linear's codes straight into oneDNN's"
            ' own pack layout (learned and checked per weight shape at start) and multiplies that, '
            "where every shape's layout is known, taking oneDNN for prefill unless the start-up "
            "calibration ran MKL's packs more than 15 % faster: the packs' kernel on the same bytes, "
            'so the same outputs and speed, with ~380 MB less resident on the default model (~900 MB '
            "where MKL's packs would have served), or where the AMX GEMM serves every coded shape "
            '(`CPU_PREFILL_GEMM`); elsewhere it keeps `packs`, a float32 pack of each'
            ' weight; `codes` expands the codes for every wide step regardless (into a plain weight '
            'that oneDNN reorders on each call where the layout is not known: prefill at ~0.93x). '
            'Decode never reaches these (`docs/engine.md`, "Prefill from the codes")'
        ))
    host_memory_idle_release_s: float = Field(5.0, ge=0,
        description=(
            'on CPU, once no step has run for this many seconds the worker hands the memory its steps'
            " freed back to the system (kept between steps otherwise: a step allocates the same "
            'buffers again), and unmaps the pages of the shared libraries it is not running; the '
            'next steps fault them in again (a few ms). 0 never hands it back'
        ))
    host_memory_quiet_release_s: float = Field(1.0, ge=0,
        description=(
            'on CPU, a worker left with no sequence running hands back what its wide steps '
            '(HOST_MEMORY_RELEASE_ROWS) freed once no step has come for this many seconds (the '
            'release takes ~10 ms after a 1.5k-token prompt and holds the lock every allocation '
            'waits for: a prompt sent meanwhile, one sharing the prefix just prefilled, waited for '
            'it). 0 releases right after the step, while its reply goes back'
        ))
    host_memory_release_rows: int = Field(256, ge=0,
        description=(
            'on CPU, steps of at least this many rows (prefill chunks) count as wide, and what a burst '
            'of them freed goes back at the first narrower step after it that decodes (or every 8th '
            'in a row), or once the worker is quiet (HOST_MEMORY_QUIET_RELEASE_S): the next burst '
            'faults its buffers in again, and the worker stays near its live size instead '
            "of keeping every wide step's pages (~25-30 MB more at a 64-block pool under eight W1 "
            "streams, ~600 MB at c32 with the default pool). 0 keeps them"
        ))
    cpu_thread_policy: Literal[CPU_THREAD_POLICIES] = Field('adaptive',
        description=(
            'on CPU, `adaptive` tries steps on one thread fewer when its threads wait for a CPU (or '
            "the cgroup quota throttles them) a fifth of their time or more, keeps that count only "
            'while its steps cost less per token, and tries more again with backoff (5-60 s), or at '
            'once when the allowed CPUs sit idle while its threads do not wait, so '
            'another process on the cores slows steps instead of stalling each barrier for a time '
            'slice; `fixed` keeps the count of TORCH_THREADS (by default the allowed CPUs, no more '
            "than the cgroup quota's whole CPUs)"
        ))
    cpu_prefill_gemm: Literal[CPU_PREFILL_GEMM_MODES] = Field('auto',
        description=(
            "the GEMM of those wide steps where they run from the codes: `auto` takes the engine's "
            'own AVX2 kernel (`native/prefill_gemm.c`, the weight expanded from its codes into panels'
            " of 16 columns) for each weight shape whose outputs equal oneDNN's bit for bit on probes"
            ' of 7, 40 and 300 rows at start and which a 7-round calibration at 1,024 rows runs '
            'faster, so the tokens never change; on a 2-core AMD EPYC Zen 3 it served all 5 of the '
            "default model's shapes, 1.15-1.34x faster, and prefill ran ~11 % faster "
            '(`docs/engine.md`, "A prefill GEMM of our own"); on a CPU with AMX-BF16 `auto` takes the '
            'AMX GEMM (`native/amx_coded_gemm.c`: the codes times each activation split into three '
            'bfloat16 pieces that add up to it exactly, the exact products added in float32) for all '
            "of the model's shapes where each one's outputs stay within a float32 GEMM's rounding bound "
            "of the float64 product at start and a 5-round calibration at 1,024 rows, summed over the "
            "model's linears, runs it faster than what serves them otherwise (else for none, so that "
            "the bits do not hang on one shape's timing): float32 arithmetic in another order than oneDNN's, so other last bits (the same "
            'greedy tokens on W1 measured), and the layers then keep no float32 pack; `native` takes the'
            " AVX2 kernel for every shape it runs (other bits where oneDNN's order differs); `amx` the "
            "AMX GEMM for every shape within the bound; `library` keeps oneDNN's (or torch's)"
        ))
    lm_head_screen: Literal[LM_HEAD_SCREEN_MODES] = Field('auto',
        description=(
            'greedy and top-k (k <= 64) rows without logprobs on float32 CPU engines take their '
            "logits from a screen of the LM head (from the head's own 8-bit codes, or an int8 copy: "
            '`LM_HEAD_SCREEN_WEIGHTS`): approximate logits for the whole vocabulary with a proven '
            'error bound, exact float32 logits for the few tokens that can still win, so the tokens '
            'are the same as from the full head (`docs/engine.md`). `auto` builds the screen in the '
            'background for vocabularies of 32k tokens or more (about 0.3 s on the default model from'
            " its codes, 1-2 s for an int8 copy with the native C kernel, ~8 s with fbgemm's op where"
            ' no C compiler is found; steps use the full head until then), `on` builds it at start '
            'for any vocabulary, `off` never; ignored off CPU and for other dtypes'
        ))
    lm_head_screen_max_rows: int = Field(0, ge=0, le=1024,
        description=(
            'screened rows per step at most; a step with more greedy/top-k rows computes the full LM '
            "head. `0` picks by the screen's kernel: 32 with the native C kernel, 8 with fbgemm's "
            'int8 op (which costs two rows per row), past which the full head was faster on a 2-core '
            'AMD EPYC'
        ))
    lm_head_screen_weights: Literal[LM_HEAD_SCREEN_WEIGHTS] = Field('auto',
        description=(
            'what the screen multiplies: `auto` takes a head kept as 8-bit weight codes '
            "(`CPU_WEIGHT_CODES`; the default model's Q8_0 head) from its codes, exactly within each "
            'block, so it keeps no copy of the head and its bound only carries rounding (median 0.03 '
            'logits on the default model, ~1 greedy candidate a row), and any other head from an int8'
            ' copy; `copy` keeps the int8 copy of a coded head too (168 MB more on the default model,'
            ' for a screen 15-40 % faster at 1-8 rows, even at 30)'
        ))
    lm_head_screen_activations: Literal[LM_HEAD_SCREEN_ACTIVATIONS] = Field('auto',
        description=(
            'how a screen from 8-bit codes rounds each hidden state: `int16` (one scale a row), '
            "`int8` (one scale per block of the codes' 32 inputs, multiplied four inputs an "
            'instruction with AVX-512 VNNI and VBMI; falls back to `int16` elsewhere, with a warning)'
            ' or `auto`, which times both kernels on the head when the screen is built and keeps the '
            'faster at 32 rows; where that is int8, it also times both whole screens at 1-32 rows and'
            ' lets the int16 one serve the narrow steps it was faster on (up to 8 or 16 rows on the '
            'AMD EPYC Zen 5; `docs/engine.md`). The tokens are the same either way (the bound covers '
            'the rounding); int8 leaves a few more candidates for exact logits and was 1.2-1.4x '
            'faster at 30-32 rows on the AMD EPYC (Zen 4), not at 1-8 (`docs/engine.md`)'
        ))
    lm_head_screen_plane: bool = Field(False,
        description=(
            "keeps a 4-bit plane of a coded head's 8-bit codes (their high nibbles: 84 MB more on the "
            "default model's Q8_0 head) and screens one-row steps (batch-1 decodes, a cached prompt's "
            'last step) from it first: an upper bound on every token from 5/8 of the bytes, then the '
            'codes of only the panels that can hold the best tokens; the same exact logits, the '
            "one-row pass 1.2-1.5x and batch-1 decode steps 1.13-1.17x faster on a 2-core AMD EPYC "
            'Zen 5. Off by default for its memory; needs AVX2 and a head in the half form '
            '(`docs/engine.md`)'
        ))
    speculative_ngram_min: int = Field(2, ge=1, le=16,
        description=(
            'the shortest sequence suffix the worker looks up earlier in the sequence to draft from '
            '(`SPECULATIVE_TOKENS`)'
        ))
    speculative_ngram_max: int = Field(4, ge=1, le=16,
        description=(
            'the longest sequence suffix the worker looks up to draft from'
        ))
    grammar_tokenizer: Literal[GRAMMAR_TOKENIZER_MODES] = Field('first_use',
        description=(
            "when the worker builds the tokenizer structured output needs (llguidance's, from the "
            "checkpoint's `tokenizer.json`: ~3 s and ~185 MB resident on a 262k vocabulary): "
            '`first_use` when the first constrained request reaches the worker (its first token, and '
            "the worker's other steps and heartbeats, wait for the build once: llguidance holds the "
            'GIL while it builds, 2.9 s on the idle 2-vCPU AMD EPYC, inside '
            "`WORKER_HEARTBEAT_TIMEOUT_S`' 10 s; as vLLM's first structured request waits for its "
            'grammar backend), `start` in the background at start, before the worker registers'
        ))
    worker_port: int = Field(50061, ge=0, le=65535,
        description=(
            "the worker's gRPC port (the scheduler dials it for steps)"
        ))
    worker_advertise_host: str = Field('',
        description=(
            'address the scheduler dials'
        ))
    worker_id: str = Field('',
        description=(
            "the worker's name in stats and routing; empty: `worker-<hostname>-<pid>`"
        ))
    worker_metrics_port: int = Field(9102, ge=0, le=65535,
        description=(
            'Prometheus `/metrics` (0 picks a free port)'
        ))
    worker_heartbeat_interval_s: float = Field(2.0, ge=0.1,
        description=(
            "seconds between the worker's heartbeats to the scheduler (it leaves the rotation after "
            '`WORKER_HEARTBEAT_TIMEOUT_S` of silence)'
        ))
    scheduler_shards: str = Field('',
        description=(
            'scheduler shards, comma-separated `host:port` (docs/scaling.md): at start the worker '
            'joins the one with the fewest workers among those that answer (ties spread by a hash of '
            'its id), and chooses again when its shard has been unreachable for 60 s, instead of '
            '`SCHEDULER_ADDR`. Empty: `SCHEDULER_ADDR`'
        ))
    scheduler_shard_rebalance_s: float = Field(30.0, ge=0,
        description=(
            'with `SCHEDULER_SHARDS`, seconds between looks at how many workers each shard has: when '
            "the worker's shard has two or more than the emptiest, half the difference drains and "
            'moves there (its requests resume on the shard\'s other workers). 0: a worker stays '
            'with its shard while it can reach it'
        ))
    kv_publish_interval_s: float = Field(0.05, ge=0.001,
        description=(
            'seconds the worker gathers its cached-block changes before it publishes them to the '
            'kvcache index in one call'
        ))
    log_level: str = Field('info',
        description=(
            'JSON logs on stderr'
        ))
    max_loras: int = Field(4, ge=1, le=1024,
        description=(
            'LoRA adapters resident per worker; others load on demand, the least recently used '
            'evicted'
        ))
    max_lora_rank: int = Field(64, ge=1, le=1024,
        description=(
            'the largest adapter rank `r` a worker loads'
        ))
