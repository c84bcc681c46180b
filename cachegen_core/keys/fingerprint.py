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

A codec profile needs less: the same model whatever floating dtype it is loaded in.
``model_identity`` (its ``model_family``, dtype-free, and a few values of every parameter) is
recorded in a profile, and ``same_model`` compares it with a model's within the rounding of two
floating dtypes (``engine/profiles.py``).
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


# ----------------------------------------------------------------------------- the model whatever its dtype

#: Values of every parameter kept in a model's identity (evenly strided over the flattened tensor).
IDENTITY_VALUES = 8
#: How far two values of one weight may differ and still be the same weight rounded to two floating dtypes:
#: bfloat16 keeps 8 significant bits (a relative error up to 2^-8 each side), float16 flushes to zero below 2^-24.
_REL_TOL, _ABS_TOL = 2.0**-7, 1e-7


def model_family(model: Any, tokenizer: Any) -> str:
    """Hex id (32 chars) of what ``model`` is whatever floating dtype it is loaded in: its class, its config
    (dtype aside), the names and shapes of its parameters and its tokenizer, but no value."""
    h = hashlib.blake2b(digest_size=16, person=b"cachegen-fam-v1")
    _field(h, "class", type(model).__name__.encode())
    _field(h, "config", _config_bytes(model))
    for name, p in model.named_parameters():
        _field(h, "param", f"{name}|{tuple(p.shape)}".encode())
    _field(h, "tokenizer", tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()


def model_identity(model: Any, tokenizer: Any) -> dict[str, Any]:
    """What a profile records of the model it was fitted on, to serve the same model in another dtype
    (:func:`same_model`): its family, its dtype and ``IDENTITY_VALUES`` values of every parameter."""
    values: list[float] = []
    for _, p in model.named_parameters():
        if p.device.type == "meta" or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // IDENTITY_VALUES)
        values += flat[::step][:IDENTITY_VALUES].float().cpu().tolist()
    return {"family": model_family(model, tokenizer), "dtype": str(_model_dtype(model)), "weights": values}


def same_model(recorded: Any, identity: dict[str, Any]) -> bool:
    """Whether ``recorded`` (a profile's ``model_identity``, as read from its file) is ``identity``'s model: the same
    family, every recorded value within the rounding of two floating dtypes of the other (``bfloat16``, ``float16``,
    ``float32``). A model whose weights differ by more (another fine-tune) is another model."""
    if not isinstance(recorded, dict) or recorded.get("family") != identity["family"]:
        return False
    theirs, ours = recorded.get("weights"), identity["weights"]
    if not isinstance(theirs, list) or len(theirs) != len(ours) or not all(isinstance(v, (int, float)) for v in theirs):
        return False
    a, b = torch.tensor(theirs, dtype=torch.float64), torch.tensor(ours, dtype=torch.float64)
    return bool(((a - b).abs() <= _REL_TOL * torch.maximum(a.abs(), b.abs()) + _ABS_TOL).all())
