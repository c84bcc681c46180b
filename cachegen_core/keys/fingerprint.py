"""Model fingerprint: a short hex id of everything that changes the KV cache of a token.

The fingerprint covers the model config, a deterministic strided sample of every
parameter's bytes (plus its name, shape and dtype), the compute dtype and the
tokenizer's identity (vocabulary, special tokens, chat template). It is cheap
(a few thousand values per parameter, well under a second for a 135M model), does
not depend on the device the weights sit on or on the path they were loaded from,
and differs between two random initialisations of the same config.

It is an identity check against accidents (another model, dtype or tokenizer sharing
a cache), not a cryptographic commitment to every weight: a change confined to
values between the sampled strides is not seen.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

#: Values sampled per parameter (evenly strided over the flattened tensor).
SAMPLE_VALUES = 4096

# Config entries that do not change the KV (where the model came from, library
# versions, runtime switches); the compute dtype is hashed separately.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "attn_implementation",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def _field(h: Any, tag: str, data: bytes) -> None:
    """Feed one length-prefixed, tagged field so that fields cannot run into each other."""
    h.update(tag.encode())
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _config_bytes(model: Any) -> bytes:
    config = getattr(model, "config", None)
    if config is None:
        return b"{}"
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return _canonical_json({k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS})


def _param_sample(p: torch.Tensor) -> bytes:
    """Raw bytes of up to ``SAMPLE_VALUES`` evenly strided values of ``p`` (empty on meta)."""
    if p.device.type == "meta" or p.numel() == 0:
        return b""
    flat = p.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE_VALUES)
    sample = flat[::step][:SAMPLE_VALUES].contiguous().cpu()
    return sample.view(torch.uint8).numpy().tobytes()


def _model_dtype(model: Any) -> torch.dtype | None:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hex id of a tokenizer: vocabulary (sorted), added and special tokens, chat template."""
    h = hashlib.blake2b(digest_size=16, person=b"cachegen-tok-v1")
    if tokenizer is None:
        _field(h, "none", b"")
        return h.hexdigest()
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    _field(h, "size", str(len(tokenizer) if hasattr(tokenizer, "__len__") else len(vocab)).encode())
    _field(h, "vocab", _canonical_json(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))))
    special = {
        "map": getattr(tokenizer, "special_tokens_map", None),
        "all": sorted(getattr(tokenizer, "all_special_tokens", None) or []),
        "ids": sorted(getattr(tokenizer, "all_special_ids", None) or []),
    }
    _field(h, "special", _canonical_json(special))
    _field(h, "chat_template", _canonical_json(getattr(tokenizer, "chat_template", None)))
    return h.hexdigest()


def model_fingerprint(model: Any, tokenizer: Any, dtype: torch.dtype | str | None = None) -> str:
    """Hex fingerprint (32 chars) of ``model`` + ``tokenizer`` as used at ``dtype``.

    ``dtype`` is the dtype the KV is computed in; by default the model's own dtype.
    """
    h = hashlib.blake2b(digest_size=16, person=b"cachegen-mfp-v1")
    _field(h, "class", type(model).__name__.encode())
    _field(h, "config", _config_bytes(model))
    resolved = dtype if dtype is not None else _model_dtype(model)
    _field(h, "dtype", str(resolved).encode())
    for name, p in model.named_parameters():
        meta = f"{name}|{tuple(p.shape)}|{p.dtype}"
        _field(h, "param", meta.encode())
        _field(h, "sample", _param_sample(p))
    _field(h, "tokenizer", tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()
