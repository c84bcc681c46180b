"""Hostile blobs in the store: another model's, another codec's or profile's, corrupted and forged ones."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.robustness.bench import CHUNK, Bench, Tally, counting_warnings, prompt
from cachegen_core.engine import KVEngine
from cachegen_core.codec.format import unpack
from cachegen_core.keys.chunks import blob_key
from cachegen_core.stores import MemoryStore
from cachegen_core.testing.fuzz import repack_header


def plant(engine: KVEngine, text: str, blobs: Callable[[int, bytes], bytes], chunks: Sequence[int]) -> None:
    """Replace the stored blob of each of ``chunks`` (at the engine's level) by ``blobs(index, blob)``."""
    for c in engine.chunks(text):
        if c.index in chunks:
            key = blob_key(c.key, engine.level)
            engine.store.put(key, blobs(c.index, engine.store.get(key)))


def scenario_foreign_blob(bench: Bench, n: int = 3) -> dict[str, Any]:
    """Blobs of another model (same tokenizer and vocabulary) planted under this model's keys."""
    tally = Tally("foreign-model blob")
    other = Bench.tiny(seed=1)
    with counting_warnings() as w:
        for i in range(n):
            text = prompt(100 + i)
            eng = bench.engine(MemoryStore())
            eng.generate(text, max_new_tokens=1)  # stores our chunks
            foreign = other.engine(MemoryStore())
            kv = foreign.calculate_kv(text)
            plant(eng, text, lambda j, _, f=foreign, kv=kv: f.codec.encode(kv.slice(j * CHUNK, (j + 1) * CHUNK), 0, start=j * CHUNK), range(3))
            tally.ask(bench, eng, text, bad_chunks=0)
    return tally.row(w)


def scenario_other_codec_blob(bench: Bench, n: int = 3) -> dict[str, Any]:
    """Blobs of this model under another codec configuration / profile planted under our keys."""
    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.codec.profile import Profile  # noqa: PLC0415

    tally = Tally("other-codec blob")
    with counting_warnings() as w:
        for i in range(n):
            text = prompt(110 + i)
            eng = bench.engine(MemoryStore())
            eng.generate(text, max_new_tokens=1)
            kv = eng.calculate_kv(text)
            cfg = CodecConfig(sink_tokens=4) if i % 2 == 0 else CodecConfig()
            prof = None if i % 2 == 0 else Profile.fit(cfg, [kv], chunk_tokens=CHUNK, model_fingerprint=eng.fingerprint)
            other = KVCodec(cfg, prof, fingerprint=eng.fingerprint)  # same model, other codec or profile
            plant(eng, text, lambda j, _, o=other, kv=kv: o.encode(kv.slice(j * CHUNK, (j + 1) * CHUNK), 0, start=j * CHUNK), range(3))
            tally.ask(bench, eng, text, bad_chunks=0)
    return tally.row(w)


def corruptions(engine: KVEngine, rng: random.Random) -> list[tuple[str, Callable[[int, bytes], bytes]]]:
    """Ways to spoil a stored blob: byte damage, truncation, garbage, and forged well-formed blobs
    of this very model and codec (valid CRCs) with the wrong shape, tokens or non-finite values."""

    def flip(_: int, b: bytes) -> bytes:
        x = bytearray(b)
        x[rng.randrange(len(x))] ^= 1 << rng.randrange(8)
        return bytes(x)

    def forge(change: Callable[[Any], Any]) -> Callable[[int, bytes], bytes]:
        def make(_: int, b: bytes) -> bytes:
            kv = engine.codec.decode(b)
            return engine.codec.encode(change(kv), engine.level, start=unpack(b).header["start"])

        return make

    from cachegen_core.kv import KVCache  # noqa: PLC0415

    return [
        ("bit flip", flip),
        ("truncated", lambda _, b: b[: rng.randrange(len(b))]),
        ("garbage", lambda _, b: rng.randbytes(len(b))),
        ("empty", lambda _, b: b""),
        ("forged header: level", lambda _, b: repack_header(b, lambda h: h.update(level=3))),  # valid CRC, other level
        ("forged: fewer layers", forge(lambda kv: KVCache(kv.keys[:-1], kv.values[:-1]))),
        ("forged: fewer kv heads", forge(lambda kv: KVCache(kv.keys[:, :1], kv.values[:, :1]))),
        ("forged: smaller head_dim", forge(lambda kv: KVCache(kv.keys[..., :8], kv.values[..., :8]))),
        ("forged: fewer tokens", forge(lambda kv: kv.slice(0, CHUNK - 3))),
    ]


def scenario_corrupted_blob(bench: Bench) -> dict[str, Any]:
    """Every kind of spoiled blob in the store, in the first and in a middle chunk."""
    tally = Tally("corrupted blob in store")
    rng = random.Random(0)
    kinds: list[str] = []
    with counting_warnings() as w:
        for i, where in enumerate((0, 1)):
            text = prompt(120 + i)
            eng = bench.engine(MemoryStore())
            eng.generate(text, max_new_tokens=1)
            good = {c.index: eng.store.get(blob_key(c.key, 0)) for c in eng.chunks(text)}
            for name, spoil in corruptions(eng, rng):
                kinds.append(name)
                for idx, blob in good.items():
                    eng.store.put(blob_key(eng.chunks(text)[idx].key, 0), blob)
                plant(eng, text, spoil, [where])
                info = tally.ask(bench, eng, text, bad_chunks=where)
                if name == "forged header: level" and info is not None:  # a relabelled blob is the same KV: fine
                    tally.wrong_kv_accepted -= int(info.cached_tokens > where * CHUNK)
    row = tally.row(w)
    row["corruptions"] = sorted(set(kinds))
    return row
