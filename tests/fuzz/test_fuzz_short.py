"""A short fuzz run for CI (the bounded long run is ``python -m benchmarks.fuzz``), and checks of the oracle.

The fuzzer lives in ``cachegen_core.testing.fuzz``, shared with the benchmarks."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cachegen_core.coders import available_coders
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.kv import KVCache
from cachegen_core.testing import fuzz as H

BAD = ("crash", "hang", "overalloc", "wrong_kv_accepted")


@pytest.fixture(scope="module")
def seeds() -> list[H.Seed]:
    return H.make_seeds(0)


def test_seeds_cover_every_coder_level_and_table_source(seeds):
    assert H.seed_outcomes(seeds) == []
    names = {s.name for s in seeds}
    for coder in available_coders():
        for variant in ("inline", "inline-many", "profile"):
            assert {f"{variant}/{coder}/kv0/L{lv}" for lv in range(4)} <= names
    many = next(s for s in seeds if s.name.startswith("inline-many/"))
    assert H.header_of(many.blob)["n_streams"] > 8  # several token blocks per layer


def test_short_fuzz_run_finds_nothing():
    rep = H.run(inputs=3000, seconds=30, seed=1, hang_s=5.0)  # generous: a loaded 2-core CI box
    summary = rep.summary()
    assert rep.inputs >= 1000, summary  # a 2-core machine does ~120-160 inputs/s with tracing
    findings = [{k: v for k, v in f.items() if k != "input_hex"} for f in rep.findings]
    assert findings == [], json.dumps(findings[:5], indent=1)
    for name, t in rep.targets.items():
        assert t.inputs > 0 and all(t.outcomes[k] == 0 for k in BAD), (name, t.summary())
    # the run must reach deep: forged blobs that pass the container and get to the coders
    codec = rep.targets["codec"]
    assert codec.outcomes["rejected"] > 0 and codec.outcomes["decoded"] > 0
    assert codec.outcomes["forged_accepted"] > 0, "no forged blob got through: the mutators stay shallow"
    for coder in available_coders():
        t = rep.targets[f"coder-{coder}"]
        assert t.outcomes["decoded"] > 0 and t.outcomes["rejected"] > 0, (coder, t.summary())


def test_crc_fixed_header_mutations_reach_the_semantic_checks(seeds):
    """Forged headers pass the container's CRC and are rejected by decode's own checks, with reasons."""
    rng = random.Random(3)
    reasons = set()
    for _ in range(300):
        s = rng.choice(seeds)
        data = H.mutate_header(rng, s.blob)
        try:
            H.header_of(data)
        except ValueError:
            continue
        try:
            s.codec.decode(data)
        except CacheGenFormatError as e:
            reasons.add(str(e).split(" ")[0:3][0])
    assert len(reasons) >= 5, reasons


def test_oracle_flags_crashes_wrong_kv_and_hangs(seeds):
    """The checks can fail: a decoder that leaks an exception, returns other KV, or stalls is caught."""
    s = next(x for x in seeds if x.kv.num_tokens > 1)

    class Leaky:
        max_tokens = H.MAX_TOKENS

        def __init__(self, behaviour: str) -> None:
            self.behaviour = behaviour

        def decode(self, blob: bytes) -> KVCache:
            if self.behaviour == "crash":
                raise IndexError("boom")
            if self.behaviour == "hang":
                import time

                time.sleep(0.3)
            if self.behaviour == "huge":
                bytearray(64 << 20)
            kv = s.codec.decode(s.blob)
            if self.behaviour == "wrong":
                return KVCache(kv.keys + 1, kv.values)
            if self.behaviour == "inf":
                return KVCache(torch.full_like(kv.keys, float("inf")), kv.values)
            return kv

    corrupted = s.blob[:-1] + bytes([s.blob[-1] ^ 1])  # a payload byte: the header stays what the oracle reads
    check = lambda b, data=s.blob, forged=False: H.check_codec(Leaky(b), data, expected=s.kv, forged=forged, hang_s=0.1)  # noqa: E731
    assert check("ok").outcome == "decoded"
    assert check("crash").outcome == "crash"
    assert check("hang").outcome == "hang"
    # a 64 MB allocation under tracemalloc can take longer than 0.1 s on a busy machine: judge it without the clock
    assert H.check_codec(Leaky("huge"), s.blob, expected=s.kv, forged=False, hang_s=30).outcome == "overalloc"
    assert check("wrong", corrupted).outcome == "wrong_kv_accepted"
    assert check("wrong", corrupted, True).outcome == "forged_accepted"
    assert check("inf", corrupted, True).outcome == "wrong_kv_accepted"


def test_hard_deadline_interrupts_a_stuck_input():
    _, exc, r = H.run_one(lambda: [None for _ in iter(int, 1)], bound=1 << 30, hang_s=0.2, hard_s=0.5, trace=False)
    assert r.outcome == "hang" and isinstance(exc, H.HardTimeout)


def test_damaged_and_forged_profile_files(seeds):
    """A profile file is read from the user cache dir: load, checks, codec and decode never crash."""
    stats = H.run_profiles(250, seed=2, seeds=seeds)
    assert stats.bad == 0, stats.findings[:5]
    assert stats.outcomes["rejected"] > 50 and stats.outcomes["decoded"] > 0, stats.summary()
