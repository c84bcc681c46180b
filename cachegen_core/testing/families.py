"""Tiny random-init models of every decoder family the engine is checked on (no downloads).

Each is 2 layers, hidden size 64, the word-level vocabulary of :func:`~.tiny.make_tiny_tokenizer`
(pad 0, bos 1, eos 2) and ``initializer_range=0.1``, so that greedy answers are not near-ties.
Sliding-window families come with a small window (:data:`WINDOW` tokens) so that a prompt of a
few hundred tokens runs past it; ``mistral-4096`` is the window Mistral-7B v0.1 ships, which a
short prompt never reaches. ``qwen3-next`` has a linear-attention layer, which the engine refuses. Shared by ``tests/test_model_families.py`` and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The sliding window of the families named ``...-window``: a test prompt should run past it.
WINDOW = 48

_COMMON: dict[str, Any] = {"vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.1}
_DECODER: dict[str, Any] = {
    **_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096,
}  # fmt: skip


def _llama(rope: dict[str, Any] | None = None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    kw = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    return LlamaForCausalLM(LlamaConfig(**_DECODER, **kw))


def _qwen2(window: bool) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    # a window set but off, as Qwen2.5 ships; or on from layer 1 (a global layer before a sliding one)
    return Qwen2ForCausalLM(Qwen2Config(**_DECODER, use_sliding_window=window, sliding_window=WINDOW, max_window_layers=1))


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: PLC0415

    return Qwen3ForCausalLM(Qwen3Config(**_DECODER, head_dim=16))


def _mistral(window: int | None) -> Any:
    from transformers import MistralConfig, MistralForCausalLM  # noqa: PLC0415

    return MistralForCausalLM(MistralConfig(**_DECODER, sliding_window=window))


def _phi3(window: int | None) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM  # noqa: PLC0415

    return Phi3ForCausalLM(Phi3Config(**_DECODER, sliding_window=window))


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: PLC0415

    # layer 0 sliding, layer 1 global; Gemma 2's logit soft-capping and query scaling at their defaults
    return Gemma2ForCausalLM(Gemma2Config(**_DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW))


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: PLC0415

    layers = ["sliding_attention", "full_attention"]
    return Gemma3ForCausalLM(Gemma3TextConfig(**_DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=layers))


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415

    return GPT2LMHeadModel(GPT2Config(**_COMMON, n_embd=64, n_layer=2, n_head=4, n_positions=1024))


def _gpt_neox() -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: PLC0415

    return GPTNeoXForCausalLM(GPTNeoXConfig(**_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))


def _opt() -> Any:
    from transformers import OPTConfig, OPTForCausalLM  # noqa: PLC0415

    return OPTForCausalLM(OPTConfig(**_COMMON, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                    word_embed_proj_dim=64, max_position_embeddings=1024))  # fmt: skip


def _falcon() -> Any:
    from transformers import FalconConfig, FalconForCausalLM  # noqa: PLC0415

    return FalconForCausalLM(FalconConfig(**_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                          new_decoder_architecture=True))  # fmt: skip


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415

    cfg = Qwen3NextConfig(**_DECODER, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                          linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                          num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)  # fmt: skip
    return Qwen3NextForCausalLM(cfg)


#: Family name -> a builder of its tiny model (random weights drawn from torch's global generator).
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "llama-rope-llama3": lambda: _llama(
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    ),  # fmt: skip
    "llama-rope-linear": lambda: _llama({"rope_type": "linear", "factor": 2.0}),
    "llama-rope-yarn": lambda: _llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "qwen2": lambda: _qwen2(False),
    "qwen2-window": lambda: _qwen2(True),
    "qwen3": _qwen3,
    "mistral": lambda: _mistral(None),
    "mistral-4096": lambda: _mistral(4096),
    "mistral-window": lambda: _mistral(WINDOW),
    "phi3": lambda: _phi3(None),
    "phi3-window": lambda: _phi3(WINDOW),
    "gemma2-window": _gemma2,
    "gemma3-text-window": _gemma3,
    "gpt2": _gpt2,
    "gpt-neox": _gpt_neox,
    "opt": _opt,
    "falcon": _falcon,
    "qwen3-next": _qwen3_next,  # a linear-attention (gated delta rule) layer: refused by the engine
}


def make_family_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """The tiny random-init causal LM of family ``name`` (a key of :data:`FAMILIES`), in eval mode."""
    torch.manual_seed(seed)
    return FAMILIES[name]().to(dtype).eval()
