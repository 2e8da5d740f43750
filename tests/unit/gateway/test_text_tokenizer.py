"""The gateway's tokenizer (tokenizers + jinja, no transformers) answers as
transformers' fast tokenizer does for every call the gateway makes, and the
gateway process never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.model_store import default_cache_dir, default_model_dir, is_prepared
from services.gateway.text.chat_template import ChatMessage, chat_prompt_ids, turn_stop_token_ids
from services.gateway.text.text_tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[3]
TEXTS = ["Hello world!", "  leading spaces and\ttabs\n\nnewlines", "Zwei Äpfel — naïve café, 東京 🙂",
         "<start_of_turn>user\nhi<end_of_turn>\n", "", "def add(a, b):\n    return a + b\n"]
TEMPLATE = ("{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('no tools') }}{% endif %}"
            "<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


def _pair(directory: Path) -> tuple[Any, TextTokenizer]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory)), TextTokenizer.from_dir(directory)


def _assert_same(reference: Any, ours: TextTokenizer) -> None:
    assert len(ours) == len(reference)
    assert sorted(ours.all_special_ids) == sorted(reference.all_special_ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.unk_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
        ids = reference(text, add_special_tokens=True)["input_ids"] + [reference.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert [ours.convert_ids_to_tokens(i) for i in ids] == reference.convert_ids_to_tokens(ids)
    for token in ("<end_of_turn>", "<bos>", "no-such-token-here"):
        assert ours.convert_tokens_to_ids(token) == reference.convert_tokens_to_ids(token)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Capital of France?"),
                ChatMessage("assistant", "Paris."), ChatMessage("user", "And Italy?")]
    assert chat_prompt_ids(ours, messages) == chat_prompt_ids(reference, messages)
    assert turn_stop_token_ids(ours) == turn_stop_token_ids(reference)


def test_matches_transformers_on_the_tiny_tokenizer(tiny_dir: Path) -> None:
    _assert_same(*_pair(tiny_dir))


def test_matches_transformers_with_a_chat_template(tmp_path: Path, tokenizer: Any) -> None:
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    reference, ours = _pair(tmp_path)
    assert ours.chat_template == reference.chat_template
    _assert_same(reference, ours)
    conversation = [{"role": "user", "content": " hi "}]
    assert ours.apply_chat_template(conversation, add_generation_prompt=True) == \
        reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    tools = [{"type": "function", "function": {"name": "東京", "parameters": {}}}]
    assert ours.apply_chat_template(conversation, add_generation_prompt=True, tools=tools) == \
        reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                      tools=tools)
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_from_tokenizer_config(tmp_path: Path, tokenizer: Any) -> None:
    tokenizer.save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [{"name": "default", "template": TEMPLATE}]
    config_file.write_text(json.dumps(config))
    assert TextTokenizer.from_dir(tmp_path).chat_template == TEMPLATE


@pytest.mark.skipif(not is_prepared(default_model_dir(default_cache_dir())),
                    reason="the default model has not been prepared on this machine")
def test_matches_transformers_on_the_default_model() -> None:
    _assert_same(*_pair(default_model_dir(default_cache_dir())))


def test_gateway_process_never_imports_torch(tiny_dir: Path) -> None:
    code = ("import sys; from pathlib import Path\n"
            "from services.gateway import main\n"
            "from services.gateway.app import create_app\n"
            "from services.gateway.settings import GatewaySettings\n"
            "from services.gateway.text.text_tokenizer import TextTokenizer\n"
            f"tokenizer = TextTokenizer.from_dir(Path({str(tiny_dir)!r}))\n"
            "create_app(GatewaySettings(), object(), tokenizer)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stderr
