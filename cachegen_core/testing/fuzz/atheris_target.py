"""Coverage-guided fuzzing of ``KVCodec.decode`` with atheris (libFuzzer for Python), when installed.

    python -m cachegen_core.testing.fuzz.atheris_target -max_total_time=60 [corpus_dir]

The first byte of an input picks a codec (inline tables, many substreams, fitted
profile: see ``seeds.make_codecs``), the rest is the blob. Half of the mutations
are libFuzzer's own byte mutations, guided by coverage of ``cachegen_core``; the other
half are the structured mutations of ``mutations`` (header fields re-packed with valid
CRCs, sections, substreams, transplants), which byte mutations alone rarely get past
the checksums with. An input that ends in anything but a ``KVCache`` consistent with
its header or a ``CacheGenFormatError`` raises, and atheris saves it as a crash.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import atheris

# Coverage of the library's modules, not of the fuzzer's own (atheris excludes exact module
# names). Every module it decodes with must be first imported here: this package's
# __init__ loads nothing (see its docstring).
HARNESS = [f"cachegen_core.testing.fuzz.{m}" for m in ("blobs", "edits", "mutations", "oracle", "seeds")]
with atheris.instrument_imports(include=["cachegen_core"], exclude=HARNESS):
    from cachegen_core.coders import available_coders
    from cachegen_core.errors import CacheGenFormatError
    from cachegen_core.kv import KVCache
    from cachegen_core.testing.fuzz import blobs, mutations, oracle, seeds

    available_coders()  # imports the native coder's module

SEEDS = seeds.make_seeds(0)
VARIANTS = list(dict.fromkeys(s.name.split("/")[0] for s in SEEDS))
CODECS = [next(s.codec for s in SEEDS if s.name.startswith(v + "/")) for v in VARIANTS]


def _prefix(seed: seeds.Seed) -> bytes:
    """The byte that selects the codec of ``seed``."""
    return bytes([VARIANTS.index(seed.name.split("/")[0])])


class Finding(Exception):
    """An input that broke a promise of the decoder."""


def test_one_input(data: bytes) -> None:
    if not data:
        return
    codec = CODECS[data[0] % len(CODECS)]
    blob = data[1:]
    try:
        kv = codec.decode(blob)
    except CacheGenFormatError:
        return
    if not isinstance(kv, KVCache):
        raise Finding(f"decode returned {type(kv).__name__}")
    why = oracle.inconsistency(kv, blobs.header_of(blob), codec.max_tokens)
    if why:
        raise Finding(why)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5 or not data:
        return atheris.Mutate(data, max_size)
    base = rng.choice(SEEDS)
    try:  # mutate the input itself when it is still a well-formed blob, else a seed
        blobs.split(data[1:])
        blob, prefix = data[1:], data[:1]
    except Exception:  # noqa: BLE001
        blob, prefix = base.blob, _prefix(base)
    seed_obj = seeds.Seed(base.name, base.codec, blob, base.kv, base.coder)
    try:
        out, _, _ = mutations.mutate(rng, seed_obj, SEEDS)
    except Exception:  # noqa: BLE001  a structured mutator that does not apply to this input
        return atheris.Mutate(data, max_size)
    return (prefix + out)[:max_size]


def write_corpus(directory: Path) -> None:
    """The seed blobs, each behind the byte that selects its codec."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(SEEDS):
        (directory / f"seed-{i:03d}").write_bytes(_prefix(s) + s.blob)


def main(argv: list[str]) -> None:
    corpus = next((Path(a) for a in argv[1:] if not a.startswith("-")), None)
    if corpus is not None:
        write_corpus(corpus)
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
