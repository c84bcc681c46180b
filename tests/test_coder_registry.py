"""The coder registry without any native build or GPU: which coders and per-device decoders are
listed, the typed errors when one cannot run here, and torchac as an optional extra."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

from cachegen_core import coders
from cachegen_core.coders import BackendUnavailable, ReferenceCoder, StreamLayout, decoder_devices, get_decoder
from cachegen_core.coders.native import NativeCoder
from cachegen_core.errors import CacheGenFormatError


@pytest.fixture
def fresh_registry():
    """Registry caches cleared before and after (a test changes what is available)."""
    coders.available_coders.cache_clear()
    coders.get_coder.cache_clear()
    yield
    coders.available_coders.cache_clear()
    coders.get_coder.cache_clear()


def _without_torchac(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "torchac" else real(name, *a, **k))


def test_decoders_known_per_coder():
    assert decoder_devices(NativeCoder.name) == ("cpu", "cuda")
    assert decoder_devices(ReferenceCoder.name) == ("cpu",)
    with pytest.raises(KeyError):
        decoder_devices("no-such-coder")


def test_cpu_decoder_is_the_coders_decode():
    freqs = np.full((1, 4), 1 << 14, np.uint32)
    layout = StreamLayout(np.array([0, 7, 7, 19], np.int64), np.zeros((3, 1), np.int32))
    sym = (np.arange(19) % 4).astype(np.uint8)
    coder = coders.default_coder()
    dec = get_decoder(coder.name)
    assert dec.device == torch.device("cpu") and dec.name == coder.name
    got = dec.decode_symbols(coder.encode(sym, layout, freqs), layout, freqs)
    assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), sym)


def test_cuda_decoder_unavailable_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(BackendUnavailable, match="CUDA") as e:
            get_decoder(NativeCoder.name, device)
        assert not isinstance(e.value, CacheGenFormatError)  # the blob is fine: no silent recompute


def test_a_coder_without_a_decoder_for_the_device():
    with pytest.raises(BackendUnavailable, match="no cuda decoder"):
        get_decoder(ReferenceCoder.name, "cuda")
    with pytest.raises(KeyError):
        get_decoder("no-such-coder", "cpu")


def test_torchac_is_listed_only_when_installed(monkeypatch, fresh_registry, tiny_kv):
    from cachegen_core.codec.kvcodec import KVCodec

    blob = KVCodec(coder=ReferenceCoder()).encode(tiny_kv.slice(0, 20), 2, start=0)
    assert ReferenceCoder.name in coders.available_coders()
    _without_torchac(monkeypatch)
    coders.available_coders.cache_clear()
    coders.get_coder.cache_clear()
    assert ReferenceCoder.name not in coders.available_coders()
    with pytest.raises(KeyError):
        coders.get_coder(ReferenceCoder.name)
    with pytest.raises(CacheGenFormatError, match="coder 'torchac', not available here"):
        KVCodec().decode(blob)


def test_no_coder_at_all_is_a_typed_error(monkeypatch, fresh_registry):
    from cachegen_core.coders import native_lib

    _without_torchac(monkeypatch)
    monkeypatch.setattr(native_lib, "available", lambda: False)
    with pytest.raises(BackendUnavailable, match="torchac is not installed"):
        coders.default_coder()


def test_listing_coders_does_not_import_torchac():
    code = "import sys; from cachegen_core import coders; from cachegen_core.codec import kvcodec; coders.available_coders(); print('torchac' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
