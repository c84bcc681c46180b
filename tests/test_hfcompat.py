"""The cache reaches the model under the name this transformers reads, without a deprecation warning."""

import logging
import warnings

import torch

from cachegen_core.engine.model import hf
from cachegen_core.hfcompat import cache_arg
from cachegen_core.kv import KVCache


def test_the_cache_given_is_the_cache_the_model_reads(tiny_llama):
    ids = torch.randint(7, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = tiny_llama(ids).logits[0, 25:]
        past = KVCache.from_dynamic_cache(tiny_llama(ids[:, :25], use_cache=True).past_key_values)
        got = tiny_llama(ids[:, 25:], **cache_arg(tiny_llama, past.to_dynamic_cache(tiny_llama.config))).logits[0]
    assert torch.allclose(got, full, atol=1e-4)  # an ignored cache would give the logits of ids[25:] alone


def test_prefill_and_generation_warn_of_no_renamed_argument(tiny_llama, tiny_tokenizer):
    ids = torch.randint(7, 128, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers logs each deprecation once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        past = hf.prefill(tiny_llama, ids[:30])
        buf = KVCache(torch.zeros(3, 2, 80, 16), torch.zeros(3, 2, 80, 16))
        hf.prefill_into(tiny_llama, ids[:50], buf, 0)
        out = hf.generate(tiny_llama, tiny_tokenizer, ids, past, 0.0, {"max_new_tokens": 3})
    logging.getLogger("transformers").removeHandler(handler)
    assert out.new_tokens == 3 and out.cache is not None
    assert not [m for m in [*map(str, (w.message for w in caught)), *logged] if "past_key_values" in m]
