"""Chunking and prefix-chained chunk keys."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen_core.keys.chunks import DEFAULT_CHUNK_TOKENS, Chunk, blob_key, chunk_keys, num_complete_chunks

IDS = {"fingerprint": "fp", "codec_id": "codec", "profile_id": "prof"}


def keys(tokens, chunk_tokens=4, **over):
    return [c.key for c in chunk_keys(tokens, chunk_tokens=chunk_tokens, **{**IDS, **over})]


def reference_key(tokens, i, chunk_tokens, fingerprint, codec_id, profile_id):
    """Non-incremental re-derivation of chunk i's key, straight from the documented layout."""
    h = hashlib.blake2b(digest_size=32, person=b"cachegen-chunkv1")
    for part in (fingerprint, codec_id, profile_id, str(chunk_tokens)):
        b = part.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    h.update(np.asarray(tokens[: (i + 1) * chunk_tokens], dtype="<u4").tobytes())
    return h.hexdigest()


def test_spans_and_only_complete_chunks():
    chunks = chunk_keys(list(range(10)), chunk_tokens=4, **IDS)
    assert [(c.index, c.start, c.end, c.num_tokens) for c in chunks] == [(0, 0, 4, 4), (1, 4, 8, 4)]
    assert chunk_keys(list(range(3)), chunk_tokens=4, **IDS) == []
    assert chunk_keys([], chunk_tokens=4, **IDS) == []
    assert len(chunk_keys(list(range(8)), chunk_tokens=4, **IDS)) == 2
    assert num_complete_chunks(3071) == 1 and num_complete_chunks(3072) == 2
    assert DEFAULT_CHUNK_TOKENS == 1536
    c = chunks[0]
    assert isinstance(c, Chunk) and re.fullmatch(r"[0-9a-f]{64}", c.key)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.key = "x"  # frozen


def test_default_chunk_tokens_is_used():
    assert len(chunk_keys(list(range(3 * 1536 + 5)), **IDS)) == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 7))
def test_matches_non_incremental_reference(tokens, chunk_tokens):
    chunks = chunk_keys(tokens, chunk_tokens=chunk_tokens, **IDS)
    assert len(chunks) == len(tokens) // chunk_tokens
    for c in chunks:
        assert c.key == reference_key(tokens, c.index, chunk_tokens, **IDS)


def test_key_depends_on_whole_prefix():
    base = list(range(100, 120))  # 5 chunks of 4
    ref = keys(base)
    for pos in range(len(base)):
        changed = base.copy()
        changed[pos] += 1
        new = keys(changed)
        j = pos // 4
        assert new[:j] == ref[:j], "chunks before the change must keep their keys"
        assert all(a != b for a, b in zip(new[j:], ref[j:])), "every chunk from the change on must miss"


def test_shared_prefix_reuses_exactly_leading_chunks():
    a = list(range(16)) + [1, 2, 3, 4]
    b = list(range(16)) + [9, 9, 9, 9]
    assert keys(a)[:4] == keys(b)[:4] and keys(a)[4] != keys(b)[4]
    assert keys(a[:12]) == keys(a)[:3]  # a longer context extends, never changes, earlier keys


@pytest.mark.parametrize("field", ["fingerprint", "codec_id", "profile_id"])
def test_every_identity_field_changes_every_key(field):
    tokens = list(range(12))
    other = keys(tokens, **{field: IDS[field] + "x"})
    assert not set(other) & set(keys(tokens))


def test_fields_cannot_run_into_each_other():
    tokens = list(range(8))
    assert keys(tokens, fingerprint="ab", codec_id="c") != keys(tokens, fingerprint="a", codec_id="bc")
    assert keys(tokens, profile_id="") != keys(tokens, profile_id="0")


def test_chunk_size_is_part_of_the_key():
    tokens = list(range(16))
    # chunk 1 of size 4 and chunk 0 of size 8 end at the same token but cover different spans
    assert keys(tokens, chunk_tokens=4)[1] != keys(tokens, chunk_tokens=8)[0]


def test_accepts_list_numpy_and_torch_alike():
    tokens = [5, 70000, 3, 2**31, 0, 1, 2, 3]
    ref = keys(tokens)
    assert keys(np.array(tokens, dtype=np.int64)) == ref
    assert keys(np.array(tokens, dtype=np.uint32)) == ref
    assert keys(torch.tensor(tokens, dtype=torch.int64)) == ref
    assert keys(tuple(tokens)) == ref


@pytest.mark.parametrize(
    "bad",
    [[-1, 0, 1, 2], [0, 1, 2, 2**32], [[1, 2, 3, 4]], [0.5, 1.0, 2.0, 3.0]],
    ids=["negative", "too-large", "2-D", "float"],
)
def test_rejects_bad_token_ids(bad):
    with pytest.raises(ValueError):
        chunk_keys(bad if not isinstance(bad[0], list) else np.array(bad), chunk_tokens=4, **IDS)


def test_rejects_bad_chunk_size():
    with pytest.raises(ValueError):
        chunk_keys([1, 2, 3], chunk_tokens=0, **IDS)


def test_linear_time(monkeypatch):
    """Every token is hashed once: the bytes fed to the hash grow linearly, not quadratically."""
    import cachegen_core.keys.chunks as chunks_mod

    fed = []
    real_blake2b = hashlib.blake2b

    class Counting:
        def __init__(self, h):
            self.h = h

        def update(self, data):
            fed.append(len(data))
            self.h.update(data)

        def copy(self):
            return Counting(self.h.copy())

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(chunks_mod.hashlib, "blake2b", lambda **kw: Counting(real_blake2b(**kw)))
    tokens = np.random.default_rng(0).integers(0, 50000, 100 * 1536 + 7)
    t0 = time.perf_counter()
    chunks = chunk_keys(tokens, **IDS)
    elapsed = time.perf_counter() - t0
    monkeypatch.undo()
    assert len(chunks) == 100
    header = sum(8 + len(p.encode()) for p in (*IDS.values(), "1536"))
    assert sum(fed) == header + 4 * 100 * 1536
    assert [c.key for c in chunks] == keys(tokens, chunk_tokens=1536)
    assert elapsed < 1.0, f"chunk_keys took {elapsed:.3f}s for 150K tokens"


def test_blob_key():
    key = keys(list(range(4)))[0]
    assert blob_key(key, 0) == f"{key}-L0" and blob_key(key, 3) == f"{key}-L3"
    assert re.fullmatch(r"[a-zA-Z0-9_.\-/]+", blob_key(key, 2))  # valid for LangChain's LocalFileStore
    with pytest.raises(ValueError):
        blob_key(key, -1)
