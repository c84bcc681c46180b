"""Moving cached keys (RoPE re-applied) and the selective recompute (CacheBlend), on the tiny Llama."""

import pytest
import torch

from cachegen_core.engine.model import hf
from cachegen_core.engine.documents.blend import (
    BlendConfig,
    blend,
    blend_support,
    document_starts,
    forced_tokens,
    last_document_first,
    question_attention,
)
from cachegen_core.engine.model.rope import Rope, rope_of, shift_keys
from cachegen_core.hfcompat import cache_arg
from cachegen_core.kv import KVCache
from cachegen_core.testing import make_tiny_llama

PREFIX, DOCS, LENGTH = 20, [(20, 120), (125, 260)], 300  # documents with 5 tokens of text between them


def _ids(seed: int = 0, n: int = LENGTH) -> list[int]:
    return torch.randint(7, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assembled(model, ids, full, rope, preamble=(1,)):
    """A buffer with the exact prefix and each document computed on its own (after the preamble), moved into
    place: what the engine builds from document caches; and the region's cached flags."""
    buf = KVCache(torch.zeros(3, 2, LENGTH + 8, 16), torch.zeros(3, 2, LENGTH + 8, 16))
    buf.slice(0, PREFIX).keys.copy_(full.keys[:, :, :PREFIX])
    buf.slice(0, PREFIX).values.copy_(full.values[:, :, :PREFIX])
    end = DOCS[-1][1]
    cached = torch.zeros(end - PREFIX, dtype=torch.bool)
    for s, e in DOCS:
        kv = hf.prefill(model, [*preamble, *ids[s:e]]).slice(len(preamble))
        shift_keys(kv.keys, s - len(preamble), rope)
        buf.slice(s, e).keys.copy_(kv.keys)
        buf.slice(s, e).values.copy_(kv.values)
        cached[s - PREFIX : e - PREFIX] = True
    return buf, cached


def test_moving_post_rope_keys_equals_computing_them_at_the_new_position(tiny_llama):
    ids = _ids(1, 100)
    rope = rope_of(tiny_llama)
    assert isinstance(rope, Rope)
    at0 = hf.prefill(tiny_llama, ids)
    for delta in (1, 37, 3000):
        with torch.no_grad():
            out = tiny_llama(torch.tensor([ids]), position_ids=torch.arange(delta, delta + 100)[None], use_cache=True)
        there = KVCache.from_dynamic_cache(out.past_key_values)
        keys = at0.keys.clone()
        shift_keys(keys, delta, rope)
        # float32 rounding of the model's own angles (thousands of radians at position 3000) bounds the match
        assert torch.allclose(keys, there.keys, atol=2e-4)
        assert torch.allclose(at0.values, there.values, atol=2e-4)  # values carry no position
    back = at0.keys.clone()
    shift_keys(back, 500, rope)
    shift_keys(back, -500, rope)
    assert torch.allclose(back, at0.keys, atol=1e-5)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_types_whose_frequencies_follow_the_sequence_are_refused(rope_type):
    model = make_tiny_llama()
    model.model.rotary_emb.rope_type = rope_type  # what such a config loads as
    assert "changes its frequencies" in rope_of(model)
    assert "changes its frequencies" in blend_support(model)


def test_other_architectures_are_refused_with_a_reason(tiny_llama):
    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    assert "not of the Llama family" in blend_support(Other())
    assert isinstance(blend_support(tiny_llama), Rope)


def test_recomputing_every_token_reproduces_full_prefill_kv_and_first_token(tiny_llama):
    ids = _ids()
    full = hf.prefill(tiny_llama, ids)
    buf, cached = _assembled(tiny_llama, ids, full, blend_support(tiny_llama))
    end = DOCS[-1][1]
    assert blend(tiny_llama, ids, buf, PREFIX, end, cached, 1.0) == end - PREFIX
    assert torch.allclose(buf.keys[:, :, :end], full.keys[:, :, :end], atol=1e-4)
    assert torch.allclose(buf.values[:, :, :end], full.values[:, :, :end], atol=1e-4)
    hf.prefill_into(tiny_llama, ids[end:], buf, end)
    with torch.no_grad():
        ref = tiny_llama(torch.tensor([ids])).logits[0, -1]
        last = tiny_llama(torch.tensor([ids[-1:]]), **cache_arg(tiny_llama, buf.slice(0, LENGTH - 1).to_dynamic_cache(tiny_llama.config))).logits[
            0, -1
        ]
    assert int(last.argmax()) == int(ref.argmax()) and torch.allclose(last, ref, atol=1e-3)


def test_recomputing_no_token_is_plain_concatenation_but_computes_the_text_between(tiny_llama):
    ids = _ids()
    full = hf.prefill(tiny_llama, ids)
    buf, cached = _assembled(tiny_llama, ids, full, blend_support(tiny_llama))
    before = KVCache(buf.keys.clone(), buf.values.clone())
    end = DOCS[-1][1]
    gap = slice(DOCS[0][1], DOCS[1][0])
    assert blend(tiny_llama, ids, buf, PREFIX, end, cached, 0.0) == gap.stop - gap.start  # only the text between
    for s, e in DOCS:  # every document token keeps its cached KV, bit for bit
        assert torch.equal(buf.keys[:, :, s:e], before.keys[:, :, s:e]) and torch.equal(buf.values[:, :, s:e], before.values[:, :, s:e])
    assert torch.allclose(buf.keys[0, :, gap], full.keys[0, :, gap], atol=1e-5)  # layer 0: context-free, exact
    adjacent = torch.ones(DOCS[0][1] - PREFIX, dtype=torch.bool)  # documents only: nothing to do at all
    assert blend(tiny_llama, ids, before, PREFIX, DOCS[0][1], adjacent, 0.0) == 0


def test_a_partial_recompute_moves_the_kv_towards_full_prefill(tiny_llama):
    ids = _ids(3)
    full = hf.prefill(tiny_llama, ids)
    end = DOCS[-1][1]
    errors = []
    for ratio in (0.0, 0.3, 0.7):
        buf, cached = _assembled(tiny_llama, ids, full, blend_support(tiny_llama))
        n = blend(tiny_llama, ids, buf, PREFIX, end, cached, ratio)
        assert n == 5 + int(torch.ceil(torch.tensor(ratio * int(cached.sum()))))
        errors.append(float((buf.values[:, :, :end] - full.values[:, :, :end]).pow(2).sum()))
    assert errors[0] > errors[1] > errors[2]


def test_the_last_document_comes_first_its_head_and_tail_when_it_does_not_fit():
    cached = torch.ones(DOCS[-1][1] - PREFIX, dtype=torch.bool)
    cached[DOCS[0][1] - PREFIX : DOCS[1][0] - PREFIX] = False  # the text between: no cached KV
    last = range(DOCS[1][0] - PREFIX, DOCS[1][1] - PREFIX)  # region indices of the last document (135 tokens)
    assert last_document_first(DOCS, PREFIX, cached, 1.0, 8).nonzero().flatten().tolist() == list(last)  # it fits
    head_and_tail = last_document_first(DOCS, PREFIX, cached, 0.1, 8)  # budget ceil(23.5) = 24: 8 first, 16 last
    assert head_and_tail.nonzero().flatten().tolist() == list(last[:8]) + list(last[-16:])
    assert not last_document_first(DOCS, PREFIX, cached, 0.0, 8).any()  # ratio 0: nothing, concatenation


def test_epics_pick_is_each_documents_first_tokens_the_budget_split_evenly():
    cached = torch.ones(DOCS[-1][1] - PREFIX, dtype=torch.bool)
    cached[DOCS[0][1] - PREFIX : DOCS[1][0] - PREFIX] = False  # the text between: no cached KV
    starts = [s - PREFIX for s, _ in DOCS]
    at = lambda mask: mask.nonzero().flatten().tolist()  # noqa: E731
    assert at(document_starts(DOCS, PREFIX, cached, 7)) == [*range(starts[0], starts[0] + 4), *range(starts[1], starts[1] + 3)]
    budget = 36  # ceil(0.15 * 235)
    epic = forced_tokens(BlendConfig(select="document_starts"), DOCS, PREFIX, cached, question=True)
    assert at(epic) == [*range(starts[0], starts[0] + 18), *range(starts[1], starts[1] + 18)] and len(at(epic)) == budget
    assert forced_tokens(BlendConfig(), DOCS, PREFIX, cached, question=True) is None  # the question's attention picks all
    no_question = forced_tokens(BlendConfig(), DOCS, PREFIX, cached, question=False)
    assert torch.equal(no_question, last_document_first(DOCS, PREFIX, cached, 0.15, 128))  # nothing to score with: the last
    sinks = forced_tokens(BlendConfig(sink_tokens=4), DOCS, PREFIX, cached, question=True)
    assert at(sinks) == [*range(starts[0], starts[0] + 4), *range(starts[1], starts[1] + 4)]  # the rest left to the pick
    assert not forced_tokens(BlendConfig(select="document_starts", recompute_ratio=0.0), DOCS, PREFIX, cached, True).any()


def test_the_first_tokens_are_recomputed_within_the_budget_and_nothing_else_moves(tiny_llama):
    ids = _ids(4)
    full = hf.prefill(tiny_llama, ids)
    buf, cached = _assembled(tiny_llama, ids, full, blend_support(tiny_llama))
    before = KVCache(buf.keys.clone(), buf.values.clone())
    end = DOCS[-1][1]
    first = last_document_first(DOCS, PREFIX, cached, 0.5, 10)  # budget ceil(117.5) = 118 of the last 135: all first
    assert int(first.sum()) == 118
    assert blend(tiny_llama, ids, buf, PREFIX, end, cached, 0.5, first=first) == 5 + 118  # none picked by deviation
    moved = (buf.keys[1:, :, :end] != before.keys[1:, :, :end]).any(-1).any(1).any(0)  # per token, layers 1+
    picked = first.nonzero().flatten() + PREFIX
    gap = torch.arange(DOCS[0][1], DOCS[1][0])
    assert moved.nonzero().flatten().tolist() == sorted([*picked.tolist(), *gap.tolist()])
    assert torch.equal(buf.keys[:, :, DOCS[0][0] : DOCS[0][1]], before.keys[:, :, DOCS[0][0] : DOCS[0][1]])


def test_question_attention_is_the_models_own_attention_of_the_last_tokens():
    """Over the exact KV of a full prefill, it sums the roots of what the model's eager attention gives the region."""
    model = make_tiny_llama(seed=2)
    model.set_attn_implementation("eager")
    ids, end = _ids(5), DOCS[-1][1]
    full = hf.prefill(model, ids[:end])
    buf = KVCache(torch.zeros(3, 2, LENGTH, 16), torch.zeros(3, 2, LENGTH, 16))
    buf.slice(0, end).keys.copy_(full.keys)
    buf.slice(0, end).values.copy_(full.values)
    cached = torch.ones(end - PREFIX, dtype=torch.bool)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    want = sum(a[0, :, end:, PREFIX:end].sqrt().sum((0, 1)) for a in out.attentions)  # the 40 tokens after end
    got = question_attention(model, ids, buf, PREFIX, end, cached, last=LENGTH - end)
    assert torch.allclose(got, want, atol=1e-4) and got.sum() > 0
    fewer = question_attention(model, ids, buf, PREFIX, end, cached, last=16)  # the question's first tokens left out
    assert not torch.allclose(fewer, want, atol=1e-2)


def test_question_attention_sees_no_uncomputed_token_and_needs_a_question(tiny_llama):
    ids, end = _ids(6), DOCS[-1][1]
    buf, cached = _assembled(tiny_llama, ids, hf.prefill(tiny_llama, ids), blend_support(tiny_llama))
    buf.keys[:, :, DOCS[0][1] : DOCS[1][0]] = float("nan")  # the text between the documents: not computed yet
    scores = question_attention(tiny_llama, ids, buf, PREFIX, end, cached)
    assert torch.isfinite(scores).all() and not scores[~cached].any() and (scores[cached] > 0).all()
    assert not question_attention(tiny_llama, ids[:end], buf, PREFIX, end, cached).any()  # nothing after the documents


def test_the_blend_recomputes_the_tokens_scoring_highest(tiny_llama):
    ids, end = _ids(7), DOCS[-1][1]
    buf, cached = _assembled(tiny_llama, ids, hf.prefill(tiny_llama, ids), blend_support(tiny_llama))
    before = KVCache(buf.keys.clone(), buf.values.clone())
    scores = torch.zeros(end - PREFIX)
    top = torch.tensor([3, 50, 150, 200])  # in both documents
    scores[top] = 1.0
    assert blend(tiny_llama, ids, buf, PREFIX, end, cached, 4 / int(cached.sum()), scores=scores) == 5 + 4
    moved = (buf.keys[1:, :, :end] != before.keys[1:, :, :end]).any(-1).any(1).any(0)
    assert moved.nonzero().flatten().tolist() == sorted([*(top + PREFIX).tolist(), *range(DOCS[0][1], DOCS[1][0])])


def test_picking_by_scores_before_layer_0_still_reproduces_full_prefill(tiny_llama):
    """Scores pick before any layer runs (no pass over the others): every token picked is full prefill exactly."""
    ids, end = _ids(8), DOCS[-1][1]
    full = hf.prefill(tiny_llama, ids)
    buf, cached = _assembled(tiny_llama, ids, full, blend_support(tiny_llama))
    assert blend(tiny_llama, ids, buf, PREFIX, end, cached, 1.0, scores=torch.rand(end - PREFIX)) == end - PREFIX
    assert torch.allclose(buf.keys[:, :, :end], full.keys[:, :, :end], atol=1e-4)
    assert torch.allclose(buf.values[:, :, :end], full.values[:, :, :end], atol=1e-4)


def test_blend_config_is_checked():
    with pytest.raises(ValueError, match="check_layer"):
        BlendConfig(check_layer=0)
    with pytest.raises(ValueError, match="recompute_ratio"):
        BlendConfig(recompute_ratio=1.5)
    with pytest.raises(ValueError, match="head_tokens"):
        BlendConfig(head_tokens=-1)
    with pytest.raises(ValueError, match="sink_tokens"):
        BlendConfig(sink_tokens=-1)
    with pytest.raises(ValueError, match="select"):
        BlendConfig(select="random")
