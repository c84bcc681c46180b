"""The fuzzers of ``cachegen_core.testing.fuzz`` as robustness rows (the long run is ``benchmarks.fuzz``)."""

from __future__ import annotations

from typing import Any

from cachegen_core.testing import fuzz as H
from cachegen_core.testing.fuzz import native


def scenario_fuzz(inputs: int, seconds: float, seed: int = 0) -> list[dict[str, Any]]:
    """The structured fuzzer, one row per target (container, codec, every coder)."""
    H.warm_up()
    rep = H.run(inputs, seconds, seed=seed)
    rows = []
    for name, t in rep.targets.items():
        s = t.summary()
        o = t.outcomes
        rows.append({
            "scenario": f"fuzz-{name}",
            "inputs": s["inputs"],
            "crashes": o["crash"],
            "hangs": o["hang"],
            "wrong_kv_accepted": o["wrong_kv_accepted"],
            "answered": o["decoded"] + o["rejected"] + o["forged_accepted"],
            "requests": s["inputs"],
            "decoded": o["decoded"],
            "rejected": o["rejected"],
            "forged_accepted": o["forged_accepted"],
            "overalloc": o["overalloc"],
            "max_input_s": s["max_input_s"],
            "max_peak_over_bound": s["max_peak_over_bound"],
        })  # fmt: skip
    prof = H.run_profiles(max(200, inputs // 20), seed=seed)
    o = prof.outcomes
    rows.append({"scenario": "fuzz-profile-file", "inputs": prof.inputs, "crashes": o["crash"], "hangs": o["hang"],
                 "wrong_kv_accepted": 0, "answered": o["decoded"] + o["rejected"], "requests": prof.inputs,
                 "rejected": o["rejected"], "loaded": o["decoded"], "overalloc": o["overalloc"]})  # fmt: skip
    return rows


def scenario_libfuzzer(seconds: float) -> dict[str, Any]:
    res = native.run(seconds)
    if not res.get("available"):
        return {"scenario": "fuzz-native-libfuzzer", "skipped": res.get("reason", "")[:200]}
    return {"scenario": "fuzz-native-libfuzzer", "inputs": res["inputs"], "crashes": res["crashes"], "hangs": res["hangs"],
            "wrong_kv_accepted": 0, "answered": res["inputs"] if not res["crashes"] else 0, "requests": res["inputs"],
            "seconds": res["seconds"], "sanitizers": "address,undefined"}  # fmt: skip
