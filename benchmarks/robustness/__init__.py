"""Robustness scenarios: hostile blobs, dead, slow, full and read-only stores, concurrency; JSON lines out.

    python -m benchmarks.robustness [--quick] [--only NAME ...] [--out F]

One line per scenario, with at least ``scenario``, ``inputs``, ``crashes``, ``hangs``,
``wrong_kv_accepted``, ``answered`` and ``requests``:

- ``fuzz-container``, ``fuzz-codec``, ``fuzz-coder-<name>`` (every coder of
  ``available_coders()``), ``fuzz-native-libfuzzer``: the fuzzers of ``cachegen_core.testing.fuzz``.
  ``inputs``/``requests``: inputs tried; ``answered``: inputs that ended in a decoded KV
  or a ``CacheGenFormatError``; ``wrong_kv_accepted``: see ``cachegen_core.testing.fuzz``.
- the engine scenarios run the tiny random Llama of ``cachegen_core.testing`` with a real store
  (``redis-server``, diskcache). ``requests``: prompts sent; ``answered``: requests
  that returned exactly the plain model's greedy text; ``crashes``: requests that
  raised; ``hangs``: requests over ``HANG_S``; ``wrong_kv_accepted``: requests that used
  (counted as cached tokens) a chunk whose stored blob was foreign, corrupted or
  forged; ``warnings``: WARNING records logged by ``cachegen_core`` during the scenario
  (a failure must be logged once, not per chunk or token).

The same functions back ``tests/test_robustness.py``, which asserts on their results. By what
they attack: ``blobs`` (foreign, other-codec, corrupted and forged blobs), ``stores`` (redis
killed, restarted, slow; diskcache full; a read-only directory), ``concurrency`` (threads on one
engine), ``batching`` (faults under load: the store killed and restarted, a forged blob and a failing request among
16 users batched), ``fuzzing`` (the decoders); ``bench`` and ``plumbing`` hold what they share.
"""

from benchmarks.robustness.batching import scenario_batched_faults
from benchmarks.robustness.bench import CHUNK, HANG_S, NEW_TOKENS, Bench, Tally, WarningCounter, counting_warnings, prompt
from benchmarks.robustness.blobs import corruptions, plant, scenario_corrupted_blob, scenario_foreign_blob, scenario_other_codec_blob
from benchmarks.robustness.concurrency import scenario_concurrent
from benchmarks.robustness.fuzzing import scenario_fuzz, scenario_libfuzzer
from benchmarks.robustness.plumbing import DelayProxy, HookedStore, redis_server
from benchmarks.robustness.stores import (
    scenario_diskcache_full,
    scenario_read_only_dir,
    scenario_redis_cluster_failover,
    scenario_redis_killed_mid_stream,
    scenario_redis_restarted,
    scenario_slow_redis,
)

__all__ = [
    "scenario_batched_faults",
    "CHUNK", "HANG_S", "NEW_TOKENS", "Bench", "DelayProxy", "HookedStore", "Tally", "WarningCounter", "corruptions",
    "counting_warnings", "plant", "prompt", "redis_server", "scenario_concurrent", "scenario_corrupted_blob",
    "scenario_diskcache_full", "scenario_foreign_blob", "scenario_fuzz", "scenario_libfuzzer", "scenario_other_codec_blob",
    "scenario_read_only_dir", "scenario_redis_cluster_failover", "scenario_redis_killed_mid_stream", "scenario_redis_restarted", "scenario_slow_redis",
]  # fmt: skip
