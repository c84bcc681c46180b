"""The fuzz loop over the three targets (container, codec, every coder) and its statistics."""

from __future__ import annotations

import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachegen_core.coders import available_coders, get_coder

from .coder_cases import check_coder, coder_case
from .mutations import mutate
from .oracle import OUTCOMES, Result, check_codec, check_container
from .seeds import Seed, make_seeds


@dataclass
class TargetStats:
    """Outcome counts of one target, with the first few findings."""

    inputs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    by_mutator: Counter = field(default_factory=Counter)
    findings: list[dict[str, Any]] = field(default_factory=list)
    max_seconds: float = 0.0
    max_peak_over_bound: float = 0.0

    def add(self, res: Result, mutator: str, data: bytes | None = None, seed: str = "") -> None:
        self.inputs += 1
        self.outcomes[res.outcome] += 1
        self.by_mutator[f"{mutator}:{res.outcome}"] += 1
        self.max_seconds = max(self.max_seconds, res.seconds)
        if res.bound_bytes:
            self.max_peak_over_bound = max(self.max_peak_over_bound, res.peak_bytes / res.bound_bytes)
        if res.outcome in ("crash", "hang", "overalloc", "wrong_kv_accepted") and len(self.findings) < 20:
            f = {"outcome": res.outcome, "detail": res.detail, "mutator": mutator, "seed": seed}
            if data is not None:
                f["input_hex"] = data.hex() if len(data) <= 4096 else data[:4096].hex() + "..."
            self.findings.append(f)

    @property
    def bad(self) -> int:
        return sum(self.outcomes[k] for k in ("crash", "hang", "overalloc", "wrong_kv_accepted"))

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            **{k: self.outcomes.get(k, 0) for k in OUTCOMES},
            "max_input_s": round(self.max_seconds, 4),
            "max_peak_over_bound": round(self.max_peak_over_bound, 4),
        }


@dataclass
class FuzzReport:
    """Per-target statistics of a run."""

    targets: dict[str, TargetStats]
    seconds: float
    seeds: int
    coders: list[str]
    rss_growth_mb: float

    @property
    def inputs(self) -> int:
        return sum(t.inputs for t in self.targets.values())

    @property
    def findings(self) -> list[dict[str, Any]]:
        return [{"target": name, **f} for name, t in self.targets.items() for f in t.findings]

    def as_dict(self) -> dict[str, Any]:
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "seconds": round(self.seconds, 1),
            "inputs_per_s": round(self.inputs / max(self.seconds, 1e-9), 1),
            "seeds": self.seeds,
            "coders": self.coders,
            "rss_growth_mb": round(self.rss_growth_mb, 1),
            "targets": {name: t.summary() for name, t in self.targets.items()},
            "findings": len(self.findings),
        }


def _max_rss_mb() -> float:
    try:
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # pragma: no cover - not on Linux
        return 0.0


def run(
    inputs: int = 10_000,
    seconds: float = 60.0,
    *,
    seed: int = 0,
    coders: Sequence[str] | None = None,
    weights: tuple[float, float, float] = (0.15, 0.6, 0.25),
    hang_s: float = 2.0,
    trace_every: int = 1,
    progress: Callable[[FuzzReport], None] | None = None,
) -> FuzzReport:
    """Fuzz for ``inputs`` inputs or ``seconds`` seconds, whichever ends first.

    ``weights``: shares of the container, codec and direct-coder targets. ``trace_every``:
    watch allocations with ``tracemalloc`` on every n-th input (tracing slows Python down).
    """
    rss0 = _max_rss_mb()
    names = list(coders) if coders is not None else list(available_coders())
    seeds = make_seeds(seed, names)
    coder_objs = {n: get_coder(n) for n in names}
    stats: dict[str, TargetStats] = {"container": TargetStats(), "codec": TargetStats()}
    stats.update({f"coder-{n}": TargetStats() for n in names})
    rng = random.Random(seed)
    blobs = {s.blob: s for s in seeds}
    start = time.perf_counter()
    tracing = trace_every > 0
    if tracing:
        tracemalloc.start()
    done = 0
    try:
        while done < inputs and time.perf_counter() - start < seconds:
            trace = tracing and done % trace_every == 0
            target = rng.choices(["container", "codec", "coder"], weights=weights)[0]
            if target == "coder":
                name = rng.choice(names)
                coder = coder_objs[name]
                case = coder_case(rng, coder, [c for n2, c in coder_objs.items() if n2 != name])
                stats[f"coder-{name}"].add(check_coder(coder, case, hang_s=hang_s, trace=trace), case.what.split(" ")[-1])
            else:
                s = rng.choice(seeds)
                data, mut, forged = mutate(rng, s, seeds)
                if data in blobs:  # a mutation that gave back a real blob must decode to that blob's KV
                    s, forged = blobs[data], False
                if target == "container":
                    stats["container"].add(check_container(data, hang_s=hang_s, trace=trace), mut, data, s.name)
                else:
                    res = check_codec(s.codec, data, expected=s.kv, forged=forged, hang_s=hang_s, trace=trace)
                    stats["codec"].add(res, mut, data, s.name)
            done += 1
            if progress is not None and done % 2000 == 0:
                progress(FuzzReport(stats, time.perf_counter() - start, len(seeds), names, _max_rss_mb() - rss0))
    except KeyboardInterrupt:  # an interrupted run still reports what it found
        pass
    finally:
        if tracing:
            tracemalloc.stop()
    return FuzzReport(stats, time.perf_counter() - start, len(seeds), names, _max_rss_mb() - rss0)


def seed_outcomes(seeds: Sequence[Seed]) -> list[str]:
    """Sanity check of the oracle: every seed decodes to its own KV under every target."""
    bad = []
    for s in seeds:
        r = check_codec(s.codec, s.blob, expected=s.kv, forged=False, trace=False)
        if r.outcome != "decoded":
            bad.append(f"{s.name}: {r.outcome} {r.detail}")
        if check_container(s.blob, trace=False).outcome != "decoded":
            bad.append(f"{s.name}: container rejected")
    return bad
