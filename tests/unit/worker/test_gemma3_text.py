"""Our own Gemma 3 text classes (engine/models/) against transformers': the same weights
under the same names, the embedding, norms, MLP and rotary embedding bitwise, and an engine
loaded with them (MODEL_IMPL=auto) giving transformers' logits bit for bit and the same greedy
tokens; a worker building that engine never imports transformers' modelling stack. Every
checkpoint, device or setting our classes do not cover loads transformers' class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.step import NewSequence, StepBatch, WorkItem
from common.types import SamplingParams
from services.worker.engine.config import EngineConfig
from services.worker.engine.lora.registry import LoraConfig
from services.worker.engine.models.gemma3_text import Gemma3ForCausalLM
from services.worker.engine.models.loader import load_own_model, own_model_class
from services.worker.wiring import build_engine
from tests.fixtures.tiny_lora import save_random_adapter
from tests.fixtures.tiny_model import gemma3_config, llama_config, save_tiny_model
from tests.unit.worker.engine_helpers import Driver, RecordingSampler, prompt_of

PROMPTS = {"short": prompt_of(3, 1), "mid": prompt_of(9, 2), "long": prompt_of(30, 3)}
CHUNKS = {"short": 64, "mid": 4, "long": 7}
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def theirs(checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> torch.nn.Module:
    return load_own_model(checkpoint, torch.float32).eval()


def test_the_weights_are_transformers_under_the_same_names(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[name], reference[name]) for name in mine)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight       # tied, as the checkpoint says
    assert not any(t.is_meta for t in (*ours.parameters(), *ours.buffers()))
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id


def test_embedding_norms_mlp_and_rope_are_transformers_bitwise(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.config.vocab_size, (1, 11), generator=generator)
    hidden = torch.randn(1, 11, ours.config.hidden_size, generator=generator) * 3
    heads = torch.randn(1, 11, 4, ours.config.head_dim, generator=generator)
    with torch.no_grad():
        assert torch.equal(ours.model.embed_tokens(ids), theirs.model.embed_tokens(ids))
        assert torch.equal(ours.model.norm(hidden), theirs.model.norm(hidden))
        for mine, reference in zip(ours.model.layers, theirs.model.layers):
            assert torch.equal(mine.mlp(hidden), reference.mlp(hidden))
            assert torch.equal(mine.pre_feedforward_layernorm(hidden), reference.pre_feedforward_layernorm(hidden))
            assert torch.equal(mine.self_attn.q_norm(heads), reference.self_attn.q_norm(heads))
            for name in ("head_dim", "scaling", "sliding_window", "is_sliding", "layer_idx", "layer_type"):
                assert getattr(mine.self_attn, name) == getattr(reference.self_attn, name), name
        positions = torch.tensor([[0, 1, 2, 7, 100, 1000, 5000]])
        for kind in set(ours.config.layer_types):
            mine = ours.model.rotary_emb(hidden, positions, kind)
            reference = theirs.model.rotary_emb(hidden, positions, kind)
            assert all(torch.equal(a, b) for a, b in zip(mine, reference))


def _run(checkpoint: Path, **settings: str) -> tuple[torch.nn.Module, list[torch.Tensor], dict[str, list[int]]]:
    engine = build_engine(EngineConfig(model_dir=str(checkpoint), model_key="tiny", num_blocks=128,
                                       block_size=4, **settings))
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    tokens = Driver(engine).run(PROMPTS, 8, CHUNKS)
    return engine.model, [logits for logits, _ in recorder.rows], tokens


@pytest.mark.parametrize("native", ["auto", "off"])
def test_an_engine_on_our_classes_gives_transformers_logits_bitwise(checkpoint: Path, native: str) -> None:
    model, rows, tokens = _run(checkpoint, cpu_native_kernels=native)
    their_model, their_rows, their_tokens = _run(checkpoint, cpu_native_kernels=native, model_impl="transformers")
    assert isinstance(model, Gemma3ForCausalLM) and not isinstance(their_model, Gemma3ForCausalLM)
    assert tokens == their_tokens
    assert len(rows) == len(their_rows) == 24
    assert all(torch.equal(a, b) for a, b in zip(rows, their_rows))


def _with_adapter(checkpoint: Path, adapter: Path, **settings: str) -> tuple[torch.nn.Module, dict[str, list[int]],
                                                                           list[torch.Tensor]]:
    engine = build_engine(EngineConfig(model_dir=str(checkpoint), model_key="tiny", num_blocks=128, block_size=4,
                                       lora=LoraConfig(modules={"all": str(adapter)}, max_loras=2, max_rank=8),
                                       **settings))
    recorder = RecordingSampler(engine.sampler)
    engine.sampler = recorder
    requests = {"plain": (prompt_of(9, 2), None), "adapted": (prompt_of(13, 5), "all")}
    new = [NewSequence(seq_id, tuple(prompt), (), SamplingParams(), lora_name=name)
           for seq_id, (prompt, name) in requests.items()]
    tokens: dict[str, list[int]] = {seq_id: [] for seq_id in requests}
    while live := [seq_id for seq_id in requests if len(tokens[seq_id]) < 6]:
        for result in engine.step(StepBatch(new_sequences=new, work=[WorkItem(s, 5) for s in live])).results:
            assert not result.error, result
            tokens[result.seq_id].extend(result.token_ids)
        new = []
    return engine.model, tokens, [logits for logits, _ in recorder.rows]


def test_adapters_on_our_classes_give_transformers_logits_bitwise(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    adapter = tmp_path / "all"
    save_random_adapter(adapter, gemma3_config(vocab_size=config["vocab_size"]), seed=2, r=4,
                        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    model, tokens, rows = _with_adapter(checkpoint, adapter)
    their_model, their_tokens, their_rows = _with_adapter(checkpoint, adapter, model_impl="transformers")
    assert isinstance(model, Gemma3ForCausalLM) and not isinstance(their_model, Gemma3ForCausalLM)
    assert tokens == their_tokens
    assert len(rows) == len(their_rows) == 12
    assert all(torch.equal(a, b) for a, b in zip(rows, their_rows))


def test_a_worker_on_our_classes_never_imports_transformers_modelling(checkpoint: Path) -> None:
    script = (
        "import sys\n"
        "from services.worker.engine.config import EngineConfig\n"
        "from services.worker.wiring import build_engine\n"
        f"engine = build_engine(EngineConfig(model_dir={str(checkpoint)!r}, model_key='tiny', num_blocks=16))\n"
        "print(type(engine.model).__module__, sorted(m for m in ('transformers', 'torch._dynamo', 'sympy') "
        "if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "services.worker.engine.models.gemma3_text []"


def _with_config(tmp_path: Path, checkpoint: Path, **changes: object) -> Path:
    copy = tmp_path / "changed"
    copy.mkdir()
    for path in checkpoint.iterdir():
        (copy / path.name).symlink_to(path)
    (copy / "config.json").unlink()
    values = json.loads((checkpoint / "config.json").read_text())
    values.update(changes)
    (copy / "config.json").write_text(json.dumps(values))
    return copy


@pytest.mark.parametrize("changes", [{"final_logit_softcapping": 30.0}, {"hidden_activation": "silu"},
                                     {"attention_bias": True}, {"architectures": ["Gemma3ForConditionalGeneration"]},
                                     {"quantization_config": {"quant_method": "gptq"}},
                                     {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                             "rope_theta": 1e6},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 1e4}}}])
def test_a_variant_our_classes_do_not_compute_loads_transformers_class(tmp_path: Path, checkpoint: Path,
                                                                        changes: dict) -> None:
    assert own_model_class(_with_config(tmp_path, checkpoint, **changes)) is None


def test_other_models_and_settings_load_transformers_class(tmp_path: Path, checkpoint: Path) -> None:
    llama = save_tiny_model(tmp_path / "llama", llama_config(vocab_size=384))
    assert own_model_class(llama) is None
    assert own_model_class(tmp_path / "nowhere") is None
    assert own_model_class(checkpoint) is Gemma3ForCausalLM
    model, _, _ = _run(checkpoint, direct_forward="off")
    assert not isinstance(model, Gemma3ForCausalLM)         # transformers' forward is the one that serves
    with pytest.raises(ValueError, match="MODEL_IMPL"):
        build_engine(EngineConfig(model_dir=str(checkpoint), model_key="tiny", num_blocks=16, model_impl="ours"))


def test_our_model_has_no_forward_of_its_own(ours: torch.nn.Module) -> None:
    with pytest.raises(NotImplementedError, match="MODEL_IMPL=transformers"):
        ours(torch.tensor([[1, 2]]))
