"""Tables by scale class, profiles as files and store entries, the shipped profile, fitting in the background."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from cachegen_core.codec import classes
from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.fitting import CALIBRATION, FitPlan, calibration_texts, fit_profile, fit_weights, weights_by_layer
from cachegen_core.codec.format import unpack
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.profiles import SHIPPED, default_profile_path, find_profile
from cachegen_core.codec.rotary import RotarySpec
from cachegen_core.engine import KVEngine
from cachegen_core.engine.profiles import ProfileFitter, profile_key, publish, read_published
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.kv import KVCache
from cachegen_core.stores import MemoryStore
from cachegen_core.stores.signed import SignedStore
from cachegen_core.testing import words

KEY = b"deployment-key-0123456789abcdef!"
PLAN = FitPlan(texts=2, tokens=300, contexts=(96,), continuation=32, chunk_tokens=128)


@pytest.fixture(autouse=True)
def isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CACHEGEN_HMAC_KEY", raising=False)


def tiny_texts() -> list[str]:
    return [words(s, 400) for s in (11, 12)]


def test_the_bank_is_normalised_and_its_classes_match_gaussian_scales():
    bank = classes.bank(64)
    assert bank.shape == (64, 256) and (bank >= 1).all() and (bank.sum(axis=1) == 1 << 16).all()
    assert not bank.flags.writeable and (bank[:, 0] == 1).all()  # symbol 0 is never coded
    rng = np.random.default_rng(0)
    for k in (3, 20, 41, 60):  # symbols drawn from a class's law are coded in the fewest bits by that class
        x = rng.choice(256, 50_000, p=bank[k] / (1 << 16))
        assert abs(int(classes.classes_from_counts(np.bincount(x, minlength=256)[None])[0]) - k) <= 1
    for scale in (2.0, 11.0, 40.0):  # and rounded Gaussian components by the class of their scale
        x = np.clip(np.rint(rng.normal(0, scale, 20_000)), -127, 127).astype(np.int64) + 128
        k = int(classes.classes_from_counts(np.bincount(x, minlength=256)[None])[0])
        assert abs(math.log(classes.scales()[k] / scale)) < 0.15
    # the codec id binds the tables: a bank of another size is another codec
    assert CodecConfig(table_classes=32).codec_id != CodecConfig().codec_id
    assert classes.digest(64) == classes.digest(64) != classes.digest(32)


def test_without_a_profile_the_blob_carries_each_components_class(tiny_kv):
    codec = KVCodec()
    blob = codec.encode(tiny_kv, 1, start=0)
    c = unpack(blob)
    got = c.sections["classes"]
    L, H, _, D = tiny_kv.shape
    assert got.shape == (2, L, H * D) and got.dtype == np.uint8 and len(set(got.ravel().tolist())) > 1
    assert "tables" not in c.sections and c.header["tables"] == "inline"
    assert torch.equal(codec.decode(blob).keys, codec.decode(blob).keys)


def test_a_codec_with_a_profile_refuses_a_blob_coded_without_one(tiny_kv):
    """Its components are channels: the profile's transform would rebuild other KV from them (or fail on another
    shape), so it is a format error, as a blob of another profile is."""
    prof = Profile.fit(CodecConfig(), [tiny_kv], chunk_tokens=32, model_fingerprint="")
    plain, profiled = KVCodec(), KVCodec(profile=prof)
    with pytest.raises(CacheGenFormatError, match="coded without a profile"):
        profiled.decode(plain.encode(tiny_kv, 1, start=0))
    with pytest.raises(CacheGenFormatError, match="needs profile"):
        plain.decode(profiled.encode(tiny_kv, 1, start=0))


def test_a_class_past_the_bank_is_a_format_error(tiny_kv):
    from cachegen_core.codec.format import pack

    codec = KVCodec()
    c = unpack(codec.encode(tiny_kv, 1, start=0))
    sections = {k: np.array(v) for k, v in c.sections.items()}
    sections["classes"][0, 0, 0] = 64
    header = {k: v for k, v in c.header.items() if k not in ("sections", "n_streams", "streams_crc32")}
    with pytest.raises(CacheGenFormatError, match="classes"):
        codec.decode(pack(header, sections, [bytes(s) for s in c.streams]))


def test_a_profile_round_trips_through_bytes_and_is_compact(tiny_llama):
    spec = RotarySpec.from_model(tiny_llama)
    prof = fit_profile(tiny_llama, _tokenizer(), tiny_texts(), plan=PLAN, fingerprint="tiny", rotary=spec)
    assert prof.transform is not None and prof.meta["fitted_on"]["fisher_draws"] == 2
    data = prof.to_bytes()
    back = Profile.from_bytes(data)
    assert back.id == prof.id and np.array_equal(back.classes, prof.classes) and back.rotary == spec
    assert torch.equal(back.transform.synthesis, prof.transform.synthesis)
    L, H, D = 3, 2, 16
    assert prof.transform.group == prof.meta["head_group"] == 2  # both heads in one matrix (32 channels <= 256)
    # classes one byte per (level, kind, layer, component); the transform at most 8 bits per matrix entry (3-8 a
    # column) and per component a width, a column scale and a spread (7 bytes)
    assert len(data) < 4 * 2 * L * H * D + 2 * L * (H * D) ** 2 + 7 * 2 * L * H * D + 2048
    with pytest.raises(CacheGenFormatError):
        Profile.from_bytes(data[:-10])
    from safetensors.numpy import save

    for fmt in ("cachegen-profile-v2", "cachegen-profile-v4"):  # v4: the transform in float16
        old = dict(json.loads(json.dumps(prof.meta)), format=fmt)
        with pytest.raises(CacheGenFormatError, match=f"is a '{fmt}' file, this build reads cachegen-profile-v5: refit it with `cachegen profile`"):
            Profile.from_bytes(save({"classes": np.array(prof.classes)}, metadata={"cachegen_profile": json.dumps(old)}))


def test_a_stale_profile_is_reported_once_with_the_refit_command(tmp_path, caplog):
    cfg, other = CodecConfig(), CodecConfig(sink_tokens=3)
    kv = KVCache(torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8))
    Profile.fit(other, [kv], chunk_tokens=32, model_fingerprint="f" * 40).save(default_profile_path("f" * 40, other))
    with caplog.at_level(logging.WARNING, logger="cachegen_core.codec.profiles"):
        assert find_profile("f" * 40, cfg, model="my-model") is None
        assert find_profile("f" * 40, cfg, model="my-model") is None
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "fitted for codec" in msgs[0] and "cachegen profile --model my-model" in msgs[0]
    mine = Profile.fit(cfg, [kv], chunk_tokens=32, model_fingerprint="f" * 40)
    mine.save(default_profile_path("f" * 40, cfg))
    assert find_profile("f" * 40, cfg).id == mine.id and find_profile("f" * 40, cfg).origin == "the user cache"
    default_profile_path("f" * 40, cfg).write_bytes(b"damaged")  # skipped, and said once, never a crash
    with caplog.at_level(logging.WARNING, logger="cachegen_core.codec.profiles"):
        assert find_profile("f" * 40, cfg) is None and find_profile("f" * 40, cfg) is None
    assert len(caplog.records) == 2 and "not a cachegen profile" in caplog.records[1].getMessage()


def test_the_shipped_profile_is_the_reference_models_for_this_codec():
    """Fails when the codec configuration changes without the shipped profile being refitted (its README says how)."""
    files = sorted(SHIPPED.glob("*.safetensors"))
    # 30 layers x 2 kinds of one 192 x 192 float16 matrix (4.4 MB), the classes and spreads beside them
    assert len(files) == 1 and files[0].stat().st_size <= 2 * 2 * 30 * 192 * 192 + (200 << 10)
    prof = Profile.load(files[0])
    assert prof.codec_id == CodecConfig().codec_id, "refit cachegen_core/profiles/ (see its README)"
    assert files[0].name == f"{prof.model_fingerprint[:32]}-{prof.codec_id}.safetensors"
    assert (prof.meta["num_layers"], prof.meta["kv_heads"], prof.meta["head_dim"]) == (30, 3, 64)
    assert prof.transform is not None and prof.rotary is not None
    assert len(calibration_texts(CALIBRATION)) == 2
    assert find_profile(prof.model_fingerprint, CodecConfig()).origin == "shipped with the package"


def test_published_profiles_first_writer_wins_and_are_signed(tiny_llama):
    inner = MemoryStore()
    store = SignedStore(inner, KEY)
    cfg = CodecConfig()
    kv = KVCache(torch.randn(3, 2, 64, 16), torch.randn(3, 2, 64, 16))
    first = Profile.fit(cfg, [kv], chunk_tokens=32, model_fingerprint="fp")
    second = Profile.fit(cfg, [kv.slice(0, 40)], chunk_tokens=32, model_fingerprint="fp")
    assert first.id != second.id
    assert publish(store, first, cfg, tiny_llama).id == first.id
    assert publish(store, second, cfg, tiny_llama).id == first.id  # kept: first writer wins
    assert read_published(store, "fp", cfg, tiny_llama).origin == "published in the store"
    key = profile_key("fp", cfg.codec_id)
    raw = inner.get(key)
    assert raw.endswith(b"CGT1")  # signed like every value
    inner.put(key, raw[:-40] + bytes(8) + raw[-32:])  # forged: a miss, never parsed
    assert read_published(store, "fp", cfg, tiny_llama) is None
    assert read_published(MemoryStore(), "fp", cfg, tiny_llama) is None


def test_an_engine_without_a_profile_fits_one_in_the_background_for_the_next(tiny_llama, tiny_tokenizer, caplog):
    store = MemoryStore()
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        eng = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, store=store, background=False, chunk_tokens=64)
        assert eng.profile_fitter is not None and eng.codec.profile is None
        eng.profile_fitter.stop()  # the default one (calibration text); ours fits on the tiny vocabulary
        before = [c.key for c in eng.chunks(words(3, 200))]
        eng.generate(words(3, 200), max_new_tokens=2)
        fitter = ProfileFitter(eng, texts=tiny_texts(), plan=PLAN, start_after_s=60.0, quiet_s=0.0)
        assert fitter.done.wait(120) and fitter.profile is not None
    assert eng.codec.profile is None and [c.key for c in eng.chunks(words(3, 200))] == before  # keys never change under it
    assert any("engines started from now on code with it" in r.getMessage() for r in caplog.records)
    nxt = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, store=store, background=False, chunk_tokens=64)
    assert nxt.profile_fitter is None and nxt.codec.profile_id == fitter.profile.id
    assert nxt.codec.profile.origin == "published in the store"
    text, info = nxt.generate(words(3, 200), max_new_tokens=2)
    assert text and info.cached_tokens == 0  # another profile: other chunk keys
    eng.close()
    quiet = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, store=MemoryStore(), auto_profile=False)
    assert quiet.profile_fitter is None and quiet.codec.profile is None


def test_the_fitter_first_weights_an_engines_steps_by_each_layers_sensitivity(tiny_llama, tiny_tokenizer):
    """An engine without a profile codes with step weights measured when it is built; before fitting the profile, the
    fitter scales them by each (kind, layer)'s measured sensitivity (issue 48), which the engine codes with from then
    on: its chunk keys stay, its chunks decode, a warm request reuses them."""
    spec = RotarySpec.from_model(tiny_llama)
    eng = KVEngine(
        tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=64, background=False, level=2, store_options=[2], allow_text=False
    )  # the stored chunks, never the text a tiny model recomputes as fast
    w = fit_weights(tiny_llama, tiny_tokenizer, tiny_texts()[0], rotary=spec)
    eng.codec.step_weights = w
    prompt = words(3, 200)
    keys = [c.key for c in eng.chunks(prompt)]
    fitter = ProfileFitter(eng, texts=tiny_texts(), plan=PLAN, start_after_s=0.0, quiet_s=0.0)
    assert fitter.done.wait(120) and fitter.weights_refined and fitter.profile is not None
    ratio = eng.codec.step_weights / w
    assert torch.allclose(ratio, ratio[:, :, :1, :1].expand_as(ratio), rtol=1e-5)  # one multiplier per (kind, layer)
    assert ratio[:, :, 0, 0].std() > 0.05  # that differ across layers
    again = weights_by_layer(tiny_llama, tiny_tokenizer, w, tiny_texts()[0], rotary=spec)
    # weights_by_layer's, on the fitter's first text (computed there in its thread, giving way op by op: another path)
    assert torch.allclose(eng.codec.step_weights, again, rtol=1e-4, atol=0)
    assert not torch.allclose(eng.codec.step_weights, w, rtol=1e-2)
    assert [c.key for c in eng.chunks(prompt)] == keys and eng.codec.profile is None
    eng.generate(prompt, max_new_tokens=2)  # stores the chunks, coded with the new weights
    _, info = eng.generate(prompt, max_new_tokens=2)
    assert info.cached_tokens >= 128 and set(info.levels) == {2}


def test_the_background_fit_pauses_while_a_request_computes(tiny_llama, tiny_tokenizer):
    """A request arriving in the middle of the fitter's model call waits for one op at most: the fitter stops before its
    next one, lets go of the model lock, runs none while the request computes, and goes on after it (issue 46)."""
    import threading

    from tests.test_engine import plain_greedy

    eng = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=64, background=False)
    inside, go = threading.Event(), threading.Event()
    calls: list[bool] = []  # per decoder-layer call of the fitter's: whether a request was computing

    def hook(module, args):
        if threading.current_thread().name == "cachegen-profile":
            calls.append(not eng.writer.idle.is_set())
            if len(calls) == 2:  # the fitter's first model call, at its second layer (of three)
                inside.set()
                go.wait(60)

    handles = [layer.register_forward_pre_hook(hook) for layer in tiny_llama.model.layers]
    try:
        fitter = ProfileFitter(eng, texts=tiny_texts(), plan=PLAN, start_after_s=0.0, quiet_s=0.0)
        assert inside.wait(60)
        with eng.writer.busy():  # a request starts computing now
            go.set()
            assert fitter.yielding.paused.wait(60)  # at its next op
            seen = len(calls)
            prompt = words(3, 150)
            text, _ = eng.generate(prompt, max_new_tokens=3)  # the model lock is free: the request runs
            assert len(calls) == seen and fitter.yielding.paused.is_set() and not fitter.done.is_set()
        assert fitter.done.wait(120) and fitter.profile is not None  # it goes on, and finishes
    finally:
        for h in handles:
            h.remove()
    assert len(calls) > seen and not any(calls[2:])  # every later layer call ran with no request computing
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, prompt, 3)  # the fit's call, left half-way, changed nothing


def _tokenizer():
    from cachegen_core.testing import make_tiny_tokenizer

    return make_tiny_tokenizer()


def test_a_process_exits_cleanly_while_its_engine_fits_a_profile(tiny_model_dir, tmp_path):
    """The fitter stops at exit after its current model call: a torch call during finalisation aborted the interpreter."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "from cachegen_core.engine import KVEngine\n"
        "from cachegen_core.stores import MemoryStore\n"
        "from cachegen_core.testing import words\n"
        f"eng = KVEngine.from_pretrained({tiny_model_dir!r}, store=MemoryStore(), background=False, chunk_tokens=64)\n"
        "assert eng.profile_fitter is not None\n"
        "eng.generate(words(1, 100), max_new_tokens=2)\n"
        "eng.profile_fitter.quiet_s = 0.0\n"
        "import time; time.sleep(0.3)\n"
        "print('exiting', eng.profile_fitter.done.is_set())\n"
    )
    # a race (about 1 exit in 4 before the fix: the fit thread's torch destructors ran during finalisation): 3 exits
    for run in range(3):
        env = {**__import__("os").environ, "CACHEGEN_CACHE_DIR": str(tmp_path / f"cache{run}")}
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr


@pytest.mark.slow
def test_a_fresh_install_codes_the_reference_model_with_the_shipped_profile():
    from cachegen_core import models

    eng = KVEngine.from_pretrained(models.REFERENCE_MODEL, store=MemoryStore(), background=False)
    assert eng.profile_fitter is None and eng.codec.profile_id == Profile.load(next(SHIPPED.glob("*.safetensors"))).id
