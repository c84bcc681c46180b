"""Decode limits: tightened from the settings, enforced before decoding, never loosened past the codec's."""

from __future__ import annotations

import pytest

from cachegen_core.codec.kvcodec import MAX_ELEMENTS_PER_BYTE, KVCodec
from cachegen_core.engine import KVEngine
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.codec.format import read_header
from cachegen_core.codec.limits import BoundedKVCodec, DecodeLimits
from cachegen_core.stores import MemoryStore
from cachegen_core.testing import words


def test_limits_can_only_be_tightened():
    with pytest.raises(ValueError, match="hard limit"):
        DecodeLimits(max_elements_per_byte=MAX_ELEMENTS_PER_BYTE + 1)
    with pytest.raises(ValueError, match="positive"):
        DecodeLimits(max_tokens=0)
    assert type(DecodeLimits().codec()) is KVCodec  # the defaults: a plain codec
    assert type(DecodeLimits(max_elements_per_byte=MAX_ELEMENTS_PER_BYTE).codec()) is KVCodec
    codec = DecodeLimits(max_elements_per_byte=16, max_blob_bytes=1 << 20, max_elements=1 << 20, max_tokens=512).codec()
    assert isinstance(codec, BoundedKVCodec) and codec.max_tokens == 512
    assert codec.limits.max_blob_bytes == 1 << 20 and codec.limits.max_section_elements == 1 << 20


def test_the_expansion_bound_is_checked_on_the_header(tiny_kv):
    blob = KVCodec().encode(tiny_kv, 3, start=0)
    header = read_header(blob)
    elements = 2 * tiny_kv.keys.numel()
    small = elements // 100  # a forged size: 100 elements per byte
    KVCodec().check_header(header, small)  # within the codec's own bound of 2048
    with pytest.raises(CacheGenFormatError, match="max_elements_per_byte=64"):
        BoundedKVCodec(max_elements_per_byte=64).check_header(header, small)
    assert BoundedKVCodec(max_elements_per_byte=64).decode(blob).shape == tiny_kv.shape  # a real blob: ~1 element per byte


def test_an_engine_with_a_tight_bound_recomputes_instead_of_decoding(tiny_llama, tiny_tokenizer):
    """Chunks of 256 tokens at the coarsest level expand to ~1.7 elements per byte: a bound of 1 refuses them."""
    prompt = words(5, 2 * 256 + 10)
    tight = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, profile=None, store=MemoryStore(),
                                     chunk_tokens=256, level=3, store_options=[3], background=False,
                                     decode_limits=DecodeLimits(max_elements_per_byte=1))  # fmt: skip
    tight.generate(prompt, max_new_tokens=2)
    _, info = tight.generate(prompt, max_new_tokens=2)
    assert info.cached_tokens == 0 and any("max_elements_per_byte=1" in e for e in info.errors)
    loose = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, profile=None, store=tight.store,
                                     chunk_tokens=256, level=3, store_options=[3], background=False)  # fmt: skip
    assert loose.generate(prompt, max_new_tokens=2)[1].cached_tokens == 512
