"""libFuzzer + AddressSanitizer + UBSan on the native decoder (skipped where clang/libFuzzer are missing)."""

from __future__ import annotations

import pytest

from cachegen_core.testing.fuzz import native


def test_native_decoder_under_libfuzzer_and_sanitizers(tmp_path):
    if native.compiler() is None:
        pytest.skip("clang++ not found (apt-get install clang libclang-rt-14-dev)")
    res = native.run(8, workdir=tmp_path)
    if not res["available"]:
        if "fuzzer" in res["reason"].lower() or "clang_rt" in res["reason"]:
            pytest.skip(f"libFuzzer runtime missing: {res['reason'][:300]}")
        pytest.fail(res["reason"])  # the target or the coder no longer compiles
    assert res["crashes"] == 0 and res["hangs"] == 0, res
    assert res["inputs"] > 1000, res
