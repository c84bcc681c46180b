"""A structured fuzzer for the container parser, ``KVCodec.decode`` and every coder's ``decode``.

Three targets, each fed by its own generator:

- ``container``: ``format.unpack`` on mutated blobs;
- ``codec``: ``KVCodec.decode`` on mutated blobs;
- ``coder-<name>``: every coder in ``available_coders()`` called directly with random
  layouts, random tables and random or mutated payloads (valid ones must round-trip).

Seeds are real blobs: tiny random KV caches coded by every available coder, with
inline tables and with a fitted profile, one and many substreams, at every level.
Mutations come in two families. *Raw* ones (bit flips, byte insertions and
deletions, truncations, splices between blobs, preamble fields) leave the checksums
as they are, so they test that corruption is detected. *Forged* ones rewrite the
header JSON (shape, level, n_streams, sections, coder, dtypes, odd JSON types) or
the sections and substreams and re-pack the blob with correct CRC-32s: that is what
reaches the deep decode paths (semantic checks, the coders, dequantisation), and it
is what an attacker with write access to the store can do.

Every input must end in a decoded ``KVCache`` or ``CacheGenFormatError`` (a
``CoderError`` for the coders): any other exception is a *crash*; taking longer
than ``hang_s`` is a *hang*; a ``tracemalloc`` peak above ``alloc_bound`` (derived
from the input's size and the header's validated shape, capped by ``max_tokens``)
is an *overalloc*. ``wrong_kv_accepted`` counts decodes that returned KV they should
not have: a raw mutation (checksums untouched) that decodes to anything but the
seed's KV, a forged blob whose KV contradicts its own validated header (shape,
dtype, non-finite values), or a coder that returns symbols outside the alphabet or
mis-decodes an unmodified payload. Forged blobs that decode to *different but
self-consistent* KV are counted apart, as ``forged_accepted``: CRC-32 detects
corruption, not forgery (see ``docs/security.md``).

Modules, one job each: ``seeds`` (real blobs to start from), ``blobs`` (taking blobs
apart and re-packing them), ``edits`` (byte and JSON-value primitives), ``mutations``
(the mutators), ``oracle`` (running and classifying one input), ``coder_cases``
(direct coder fuzzing), ``runner`` (the loop and its statistics), ``profile_files``
(damaged profile files), ``native`` (libFuzzer + sanitizers on the C++ decoder) and
``atheris_target`` (coverage-guided fuzzing of ``KVCodec.decode``).

The names below are re-exported here and imported on first use, so that importing
this package loads nothing of ``cachegen_core``: ``atheris_target`` must import the
code it fuzzes under atheris' instrumentation, after this package is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "seeds": ["FINGERPRINT", "LIMITS", "MAX_TOKENS", "Seed", "make_codecs", "make_seeds", "warm_up"],
    "blobs": ["Parts", "dump_header", "header_of", "repack", "repack_header", "split", "with_header"],
    "edits": ["INTERESTING_INTS", "json_get", "json_paths", "json_set", "odd_value", "raw_edit"],
    "mutations": [
        "MUTATORS",
        "mutate",
        "mutate_header",
        "mutate_header_text",
        "mutate_raw",
        "mutate_sections",
        "mutate_streams",
        "mutate_table",
        "mutate_transplant",
    ],  # fmt: skip
    "oracle": [
        "OUTCOMES",
        "HardTimeout",
        "Result",
        "alloc_bound",
        "check_codec",
        "check_container",
        "hard_deadline",
        "inconsistency",
        "run_one",
        "validated_elements",
    ],  # fmt: skip
    "coder_cases": ["CoderCase", "check_coder", "coder_case"],
    "runner": ["FuzzReport", "TargetStats", "run", "seed_outcomes"],
    "profile_files": ["check_profile_file", "profile_file_cases", "run_profiles"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
