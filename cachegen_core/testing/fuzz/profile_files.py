"""Fuzzing of profile files (safetensors classes and transform + JSON metadata), as read from the user cache dir or a store."""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.codec.profile import Profile

from .edits import json_get, json_paths, json_set, odd_value, raw_edit
from .oracle import Result, run_one
from .runner import TargetStats
from .seeds import FINGERPRINT, LIMITS, MAX_TOKENS, Seed, make_codecs, make_seeds


def profile_file_cases(rng: random.Random, directory: Any, n: int) -> Iterator[tuple[str, Any]]:
    """``n`` damaged or forged profile files (safetensors classes and stored transform + JSON metadata)
    written to ``directory``.

    Structured ones rewrite the metadata (missing keys, odd JSON types and values, deep
    nesting, huge numbers) or one of the tensors (dtype, shape, values: classes past the bank,
    widths out of range, non-finite or zero scales, a singular transform) through safetensors itself; raw ones flip,
    cut or splice the file's bytes."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    _, codec, _ = make_codecs(0)[2]
    prof = codec.profile
    assert prof is not None and prof.stored is not None
    directory = Path(directory)
    good = directory / "good.safetensors"
    prof.save(good)
    raw = good.read_bytes()
    for i in range(n):
        path = directory / f"case-{i}.safetensors"
        meta: Any = json.loads(json.dumps(prof.meta))
        tensors = {"classes": np.array(prof.classes), **{k: v.copy() for k, v in prof.stored.items()}}
        r = rng.random()
        if r < 0.4:
            path_ = rng.choice(json_paths(meta)[1:])
            if rng.random() < 0.2:
                meta.pop(path_[0], None)
            else:
                meta = json_set(meta, path_, odd_value(rng, json_get(meta, path_)))
            text = json.dumps(meta)
        elif r < 0.5:
            text = rng.choice(["[" * 100_000 + "]" * 100_000, '{"format": 1' + "0" * 5000 + "}", "null", "[]", '{"a":',
                               json.dumps(meta).replace('"channels": ', '"channels": 1e999, "x": ')])  # fmt: skip
        else:
            text = json.dumps(meta)
        if 0.5 <= r < 0.7:
            _damage_tensor(rng, tensors)
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"cachegen_profile": text})
        except Exception:  # noqa: BLE001  safetensors refuses to write it: write the raw good file instead
            path.write_bytes(raw)
        if r >= 0.7:  # raw damage to the file bytes
            b = bytearray(path.read_bytes())
            raw_edit(rng, b, raw)
            path.write_bytes(bytes(b))
        yield f"profile-{'meta' if r < 0.5 else 'tensors' if r < 0.7 else 'raw'}", path


def _damage_tensor(rng: random.Random, tensors: dict[str, np.ndarray]) -> None:
    """One structured defect in one of a profile's tensors (or a tensor dropped or added)."""
    g = np.random.default_rng(rng.randrange(2**32))
    name = rng.choice(sorted(tensors))
    t = tensors[name]
    k = rng.randrange(7)
    if k == 0:
        tensors[name] = t.astype(rng.choice([np.uint8, np.int32, np.float32, np.float16, np.float64]))
    elif k == 1:
        tensors[name] = t[: max(0, t.shape[0] - rng.randint(1, 2))]
    elif k == 2:
        tensors[name] = t.reshape(-1)
    elif k == 3:
        t = t.copy()
        flat = t.reshape(-1)
        bad = {"classes": [255, 64, 200], "column_scale": [0.0, -1.0, np.inf, np.nan], "spread": [np.inf, np.nan],
               "widths": [0, 1, 9, 255], "synthesis": [255, 254, 0]}[name]  # fmt: skip
        flat[g.integers(flat.size)] = rng.choice(bad)
        tensors[name] = t
    elif k == 4 and name == "synthesis":
        tensors[name] = np.zeros_like(t)  # every entry of a column the same: singular
    elif k == 5:
        del tensors[name]
    else:
        tensors["extra"] = g.integers(0, 255, 16).astype(np.uint8)


def check_profile_file(path: Any, seeds: Sequence[Seed]) -> Result:
    """What the library does with a profile file, step by step: ``Profile.load``; the checks of
    ``find_profile`` (its model fingerprint and codec id); ``KVCodec(config, profile)`` (a
    ``ValueError`` for a profile of another codec is its documented answer); decoding the
    profile seed blobs. Each step must end in a value or ``CacheGenFormatError``."""
    cfg = next(s.codec.config for s in seeds if s.name.startswith("profile/"))

    def body() -> str:
        try:
            prof = Profile.load(path)
            _ = (prof.model_fingerprint == FINGERPRINT, prof.codec_id == cfg.codec_id)
        except CacheGenFormatError:
            return "rejected"
        try:
            codec = KVCodec(cfg, prof, fingerprint=FINGERPRINT, max_tokens=MAX_TOKENS, limits=LIMITS)
        except (CacheGenFormatError, ValueError):
            return "rejected"
        for s in seeds:
            if s.name.startswith("profile/"):
                try:
                    codec.decode(s.blob)
                except CacheGenFormatError:
                    pass
        return "decoded"

    value, exc, res = run_one(body, 64 << 20, 2.0, 20.0, True)
    if res.outcome:
        return res
    if exc is not None:
        res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc}"[:300]
    else:
        res.outcome = value
    return res


def run_profiles(n: int, seed: int = 0, seeds: Sequence[Seed] | None = None) -> TargetStats:
    """``n`` damaged or forged profile files through ``check_profile_file``."""
    seeds = list(seeds) if seeds is not None else make_seeds(seed)
    stats = TargetStats()
    with tempfile.TemporaryDirectory(prefix="cachegen-fuzz-profile-") as d:
        for name, path in profile_file_cases(random.Random(seed), d, n):
            res = check_profile_file(path, seeds)
            if res.outcome == "crash":
                res.detail += f" [{name}]"
            stats.add(res, name)
            path.unlink()
    return stats
