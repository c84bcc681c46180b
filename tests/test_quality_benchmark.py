"""The quality/size benchmark's scoring and baselines, and the profile command, on a tiny random model."""

import json

import pytest
import torch

from benchmarks import baselines
from benchmarks.quality_size import evaluate, kl_sum, names_topic, summarise
from cachegen_core.cli import main as cli
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.config import CodecConfig
from cachegen_core.kv import KVCache
from cachegen_core.codec.pipeline import components, dequantise, quantise, synthesise
from cachegen_core.codec.profile import Profile
from cachegen_core.testing import words


def test_scoring_on_a_tiny_model(tiny_llama, tiny_tokenizer):
    records = [{"prompt": words(1, 400), "label": ["w10 w11"]}]
    tallies = evaluate(tiny_llama, tiny_tokenizer, records, 96, KVCodec(), continuation_tokens=64, chunk_tokens=64,
                       task=True, zstd_level=3, progress=False)  # fmt: skip
    rows = {(r["method"], r["level"]): r for r in summarise(tallies, 96)}
    fp16 = rows[("fp16", None)]
    assert fp16["ppl_rel_delta"] == 0 and fp16["top1_agreement"] == 1.0 and fp16["bits_per_element"] == 16
    assert {m for m, _ in rows} == {"fp16", "cachegen", "uniform8", "uniform4", "uniform8-token", "kivi2", "kivi4", "zstd"}
    assert all(r["bits_per_element"] > 0 and r["n_contexts"] == 1 for r in rows.values())
    assert rows[("uniform8", None)]["bits_per_element"] < 16 and rows[("uniform4", None)]["bits_per_element"] < 6
    # 96 tokens, all inside KIVI's 128-token fp16 window: nothing to quantise, lossless
    assert rows[("kivi2", None)]["bits_per_element"] == 16 and rows[("kivi2", None)]["ppl_rel_delta"] == 0
    assert rows[("zstd", None)]["ppl_rel_delta"] == 0  # lossless
    # KL from fp16's next-token distributions: 0 where the KV is the same (the same computation twice), > 0 where lossy
    assert fp16["kl_mnat_per_token"] == 0 and rows[("zstd", None)]["kl_mnat_per_token"] == 0
    assert rows[("uniform4", None)]["kl_mnat_per_token"] > 0 and rows[("cachegen", 3)]["kl_mnat_per_token"] > 0
    assert rows[("uniform4", None)]["kl_mnat_per_token"] > rows[("uniform8", None)]["kl_mnat_per_token"]


def test_kl_sum_is_the_kl_divergence_of_the_next_token_distributions():
    g = torch.Generator().manual_seed(0)
    ref, got = torch.randn(5, 11, generator=g).log_softmax(-1), torch.randn(5, 11, generator=g).log_softmax(-1)
    want = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="sum").item()
    assert kl_sum(ref, got) == pytest.approx(want, rel=1e-5) and kl_sum(ref, ref) == 0


def test_uniform8_per_token_error_within_half_a_step(tiny_kv):
    out, nbytes = baselines.uniform_per_token(tiny_kv, 8)
    for x, y in ((tiny_kv.keys, out.keys), (tiny_kv.values, out.values)):
        t = x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
        step = (t.amax(-1) - t.amin(-1)) / 255
        err = (x - y).abs().permute(0, 2, 1, 3).reshape_as(t).amax(-1)
        assert (err <= step / 2 * 1.01 + 1e-6).all()
    assert nbytes == tiny_kv.num_elements + 4 * 2 * tiny_kv.num_layers * tiny_kv.num_tokens


def test_fair_baselines_count_their_scales_and_window(tiny_kv):
    layers, heads, tokens, dim = tiny_kv.shape  # 157 tokens
    _, n8 = baselines.uniform(tiny_kv, 8, key_group=32)
    n_groups_k = layers * heads * dim * -(-tokens // 32)
    n_groups_v = layers * heads * tokens
    assert n8 == tiny_kv.num_elements + 4 * (n_groups_k + n_groups_v)
    out, n2 = baselines.kivi(tiny_kv, 2, group=32, residual=64)
    n_q = (tokens - 64) - (tokens - 64) % 32  # 64 quantised tokens; the other 93 in fp16
    assert torch.equal(out.keys[:, :, n_q:], tiny_kv.keys[:, :, n_q:].half().float())
    assert not torch.equal(out.keys[:, :, :n_q], tiny_kv.keys[:, :, :n_q])
    fp16_bytes = 2 * 2 * layers * heads * (tokens - n_q) * dim
    scales = 4 * (layers * heads * dim * n_q // 32 + layers * heads * n_q * -(-dim // 32))
    assert n2 == 2 * layers * heads * n_q * dim * 2 // 8 + scales + fp16_bytes
    k = tiny_kv.keys[:, :, :n_q].float().reshape(layers, heads, -1, 32, dim)
    step = (k.amax(3) - k.amin(3)) / 3  # per channel, per group of tokens
    err = (out.keys[:, :, :n_q].float().reshape_as(k) - k).abs().amax(3)
    assert (err <= step / 2 * 1.01 + 1e-3).all()


def test_names_topic():
    assert names_topic("We talked about the role of art in society.", "The role of art in society")
    assert not names_topic("Mindfulness.", "The role of art in society")


def test_profile_command_writes_a_profile_the_codec_uses(tiny_llama, tiny_tokenizer, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_llama.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": words(i, 500)}) + "\n" for i in range(4)))
    out = tmp_path / "p.safetensors"
    assert cli(["profile", "--model", str(model_dir), "--texts", str(texts), "--field", "text", "--last", "4",
                "--chunk-tokens", "128", "--out", str(out)]) == 0  # fmt: skip
    profile = Profile.load(out)
    torch.manual_seed(0)
    with torch.no_grad():
        kv = KVCache.from_dynamic_cache(tiny_llama(torch.randint(7, 128, (1, 128)), use_cache=True).past_key_values)
    with_p, without = KVCodec(CodecConfig(), profile), KVCodec(CodecConfig())
    blob = with_p.encode(kv, start=0)
    assert len(blob) < len(without.encode(kv, start=0))
    # v2: the profile also carries the per-head transform, so the reconstruction is the pipeline's with it
    tf = profile.transform
    comp = components(kv, tf, start=0, sink_tokens=with_p.config.sink_tokens, rotary=profile.rotary)
    coded = quantise(comp, with_p.config.level_step(with_p.config.default_level), fitted=True, step_cap=with_p.config.step_cap)
    keys, _ = synthesise(dequantise(coded), coded.mean, coded.exact, tf, rotary=profile.rotary)
    assert torch.equal(with_p.decode(blob).keys, keys.to(kv.dtype))


def test_unprofiled_variant_options():
    from benchmarks.unprofiled import variant_options

    assert variant_options("identity") == ("identity", {})
    assert variant_options("weighted:s=4.0,c=128") == ("weighted", {"s": 4.0, "c": 128.0})
    assert variant_options("hadamard:s=3") == ("hadamard", {"s": 3.0})
    assert variant_options("refined:p=1,g=1.1,n=64,l=2,c=128") == ("refined", {"p": 1.0, "g": 1.1, "n": 64.0, "l": 2.0, "c": 128.0})
    for bad in ("rotated", "identity:c=128", "identity:p=1", "weighted:p=1", "weighted:x=1", "weighted:s=abc", "weighted:c=-5", "weighted:s"):
        with pytest.raises(SystemExit, match="unknown variant"):
            variant_options(bad)
