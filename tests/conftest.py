"""Shared fixtures: tiny random-init GQA Llama models, their KV caches and tokenizer, real redis-servers.

The helpers behind them live in ``cachegen_core.testing`` (the benchmarks use them too). Without a GPU,
Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before any kernel is made).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the GPU decoder's Triton kernels run in Triton's interpreter, on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cachegen_core.testing import make_tiny_kv, make_tiny_llama, make_tiny_tokenizer
from tests.redis_fixture import fresh_redis_server, redis_server  # noqa: F401  (real redis-server fixtures)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_kv(tiny_llama):
    """A real KV cache of the tiny model over 157 random tokens."""
    return make_tiny_kv(tiny_llama)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model and tokenizer saved as a transformers directory: a stand-in for the reference model."""
    path = tmp_path_factory.mktemp("tiny-model")
    make_tiny_llama().save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return str(path)
