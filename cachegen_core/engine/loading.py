"""Building an engine from a model's name or object: ``KVEngine.from_pretrained``.

Loads the model when given a name (``models.load_model``: a hub id is downloaded into the Hugging Face cache
on first use) and gives it the engine's attention, fills the arguments not given from the ``CACHEGEN_*`` settings, finds the
model's codec profile, and calls the engine class with the codec they make. An engine loaded by name keeps it as
``model_name`` (what the LangChain classes report: a hub model's files live in a snapshot directory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch

from ..codec.config import CodecConfig
from ..codec.profile import Profile
from ..keys.fingerprint import model_fingerprint
from ..models import load_model
from ..ops.settings import engine_options, resolve_store
from ..ops.settings import load as load_settings
from ..stores.base import KVStore
from .model.attention import use_gqa_attention
from .profiles import measure_weights, resolve_profile, start_fitting

E = TypeVar("E")


def from_pretrained(
    cls: type[E],
    path_or_model: str | Path | Any,
    *,
    tokenizer: Any = None,
    store: KVStore | None = None,
    profile: Profile | str | Path | None = "auto",
    config: CodecConfig | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | int | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    auto_profile: bool | None = None,
    **kwargs: Any,
) -> E:
    """Load a model (local dir, ``.gguf`` file, a Hugging Face hub id — downloaded into the Hugging Face cache on
    first use, ``HF_HUB_OFFLINE`` honoured — or the bundled reference model's short name) and build an engine;
    or build one on a model object of your own (any dtype, any device: it is used as it is), with its ``tokenizer``.

    ``dtype``, ``device``, ``device_map`` and ``model_kwargs`` go to ``models.load_model`` (the
    CPU by default; ``model_kwargs`` as ``from_pretrained`` takes them, ``revision``, ``token``, ``cache_dir``,
    ``local_files_only`` and ``gguf_file`` included). ``profile="auto"`` uses the model's profile for this codec configuration from
    the user cache, the package or the store (``profiles.resolve_profile``); without one chunks carry
    their own table classes, and (``auto_profile``) the model's sensitivity is measured now (about 3 s for the
    reference model on 2 CPU cores) to weight their steps, and a profile is fitted in the background and
    published into the store for the engines started after it (``profiles.ProfileFitter``; None:
    ``CACHEGEN_AUTO_PROFILE``, default on). ``profile=None``: none.
    ``CACHEGEN_*`` settings (``docs/configuration.md``) fill the arguments not given (or None);
    ``decode_limits=DecodeLimits(...)`` tightens what a stored blob may make the decoder allocate.
    """
    if isinstance(path_or_model, (str, Path)):
        device = "cpu" if device is None and device_map is None else device
        model, tok = load_model(path_or_model, dtype=dtype, device=device, device_map=device_map, model_kwargs=model_kwargs)
        use_gqa_attention(model)  # a model of our own: its grouped KV heads read in place (attention.py)
        tokenizer = tokenizer or tok
    else:
        model = path_or_model
        if tokenizer is None:
            raise ValueError("pass tokenizer= with a model object")
    fp = model_fingerprint(model, tokenizer)
    kwargs, limits = engine_options(kwargs)  # CACHEGEN_* settings fill what is not given
    config = config or CodecConfig()
    store = resolve_store(store)
    auto = profile == "auto"
    name = str(path_or_model) if isinstance(path_or_model, (str, Path)) else getattr(model, "name_or_path", "") or "MODEL"
    if auto:
        profile = resolve_profile(model, fp, config, store, name=name, tokenizer=tokenizer)
    elif isinstance(profile, (str, Path)):
        profile = Profile.load(profile)
    engine = cls(model, tokenizer, limits.codec(config, profile, fingerprint=fp), store, **kwargs)
    if isinstance(path_or_model, (str, Path)):  # the name traces report (langchain_cachegen's model_id), not a snapshot dir
        engine.model_name = str(path_or_model)  # type: ignore[attr-defined]
    if auto and profile is None and (load_settings().auto_profile if auto_profile is None else auto_profile):
        measure_weights(engine, name=name)
        engine.profile_fitter = start_fitting(engine, name=name)  # type: ignore[attr-defined]
    return engine
