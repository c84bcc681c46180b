"""The profile an engine codes with, and the one every process sharing a store comes to use.

``resolve_profile`` (``from_pretrained(profile="auto")``) takes, in order: the user cache's
profile of the model (``cachegen profile``), a shipped one (the reference model's), one of these
fitted on the same model loaded in another floating dtype (``same_model_profile``), the one
published in the store under the model fingerprint and codec id (``profile_key``), else none.
Without one the engine codes without a profile (each blob carries its components' classes),
and a ``ProfileFitter`` fits one in the background on the calibration text shipped with the
package (``codec.fitting``), then publishes it into the store, first writer wins: it keeps what
another process published first. Meanwhile the engine's codec weights its steps by the model's
sensitivity, measured when the engine is built (``measure_weights``: one short Fisher draw, ``codec.weights``)
and, by the fitter before it fits, across layers (``weights_by_layer``): that changes what its blobs hold, not
their keys or how they decode. Nothing changes under a running engine (its chunk keys bind
"no profile"): the profile serves the engines started after it exists, in this process and in
every other sharing the store, and the log says so. A signed store signs and checks it like
every value; a profile read from a store is parsed as safetensors + JSON, never unpickled.

The fitter gives way to requests (``yielding.py``): it starts once the engine has answered a request (or stood idle
for ``start_after_s``), and every torch op it runs, the model's and its own statistics', waits while a request of the
process computes, its model lock let go, until none has for ``quiet_s``; on the CPU a large matrix product runs in
blocks of rows with that check between them. A request waits for one op at most (before, for the rest of a model
call: a new 4-layer 7B-shaped model's first request on 2 cores took 1.53 s instead of 0.38 s, on an H200 10.2 s
instead of 0.24 s). It stops at exit before the interpreter finalises.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..codec.config import CodecConfig
from ..codec.fitting import FitPlan, fit_profile, fit_weights, weights_by_layer
from ..codec.profile import IDENTITY_KEY, Profile
from ..codec.profiles import SHIPPED, family_profiles, find_profile
from ..codec.rotary import RotarySpec
from ..codec.weights import check_weights
from ..errors import CacheGenError, CacheGenFormatError, StoreError
from ..keys.fingerprint import model_identity, same_model
from ..stores.base import KVStore
from .model.hf import kv_geometry
from .serving.yielding import Stopped, Yielding, stop_at_exit

log = logging.getLogger("cachegen_core.engine")

#: What measuring the model's sensitivity can raise on a model or text it cannot measure: logged, steps left as they were.
MEASURE_ERRORS = (CacheGenError, RuntimeError, ValueError, OSError, IndexError)


def profile_key(fingerprint: str, codec_id: str) -> str:
    """The store key a model's profile under a codec is published under."""
    return f"profile:{codec_id}:{fingerprint}"


def read_published(store: KVStore, fingerprint: str, config: CodecConfig, model: Any) -> Profile | None:
    """The profile published in ``store`` for this model and codec, or None (absent, unreadable, or not this
    model's: logged)."""
    key = profile_key(fingerprint, config.codec_id)
    try:
        data = store.get(key)
    except StoreError as e:
        log.warning("cannot read the published profile %s: %s", key, e)
        return None
    if data is None:
        return None
    try:
        profile = Profile.from_bytes(data, f"store entry {key}")
        m = profile.meta
        if profile.model_fingerprint != fingerprint or profile.codec_id != config.codec_id:
            raise CacheGenFormatError("it names another model or codec")
        if (m["num_layers"], m["kv_heads"], m["head_dim"]) != kv_geometry(model.config):
            raise CacheGenFormatError("its shape is not the model's")
    except CacheGenFormatError as e:
        log.warning("the published profile %s is not used: %s", key, e)
        return None
    profile.origin = "published in the store"
    return profile


def publish(store: KVStore, profile: Profile, config: CodecConfig, model: Any) -> Profile:
    """Put ``profile`` (of ``config``) into ``store`` unless one is published already (first writer wins);
    returns the profile the store holds afterwards (``profile`` itself when the store cannot be read back)."""
    first = read_published(store, profile.model_fingerprint, config, model)
    if first is not None:
        return first
    store.put(profile_key(profile.model_fingerprint, profile.codec_id), profile.to_bytes())
    return read_published(store, profile.model_fingerprint, config, model) or profile


def resolve_profile(model: Any, fingerprint: str, config: CodecConfig, store: KVStore, *, name: str = "MODEL",
                    tokenizer: Any = None) -> Profile | None:  # fmt: skip
    """The profile an engine starting now codes with (see the module doc), or None. ``tokenizer`` (the model's):
    look for a profile of the same model in another dtype too."""
    found = find_profile(fingerprint, config, model=name)
    if found is None and tokenizer is not None:
        found = same_model_profile(model, tokenizer, config)
    return found if found is not None else read_published(store, fingerprint, config, model)


def same_model_profile(model: Any, tokenizer: Any, config: CodecConfig) -> Profile | None:
    """A profile file (the user cache's, else a shipped one) fitted on this model loaded in another dtype: its family
    and its weights up to the rounding of the two dtypes (``keys.fingerprint.same_model``); None when there is none.
    What a profile holds (the transform, the tables' classes) is a property of the model's KV that rounding its
    weights to 16 bits does not change; the chunk keys still bind the fingerprint, dtype included."""
    identity = model_identity(model, tokenizer)
    for path, meta in family_profiles(identity["family"], config):
        if not same_model(meta.get(IDENTITY_KEY), identity):
            continue
        try:
            profile = Profile.load(path)
            if (profile.meta["num_layers"], profile.meta["kv_heads"], profile.meta["head_dim"]) != kv_geometry(model.config):
                raise CacheGenFormatError("its shape is not the model's")
        except CacheGenFormatError as e:
            log.warning("profile %s of the same model is not used: %s", path, e)
            continue
        fitted = meta[IDENTITY_KEY].get("dtype")
        profile.origin = f"{'shipped with the package' if path.parent == SHIPPED else 'the user cache'}, fitted on the model in {fitted}"
        log.info("profile %s (%s) serves the model in %s", profile.id, profile.origin, identity["dtype"])
        return profile
    return None


class ProfileFitter:
    """Fits a profile for ``engine``'s model in a background thread and publishes it into its store.

    Holds the engine weakly. ``texts`` and ``plan``: what it fits on (default: the shipped calibration
    text, ``codec.fitting.FitPlan()``). ``start_after_s``: start this long after construction even if no
    request has been answered; ``quiet_s``: how long the process must have had no request
    computing before it goes on after one. First, when the engine codes with step weights, it scales them by each
    layer's measured sensitivity (``weights_refined`` then True). ``done`` is set when it has finished (``profile``:
    what the store holds then, None on failure); ``yielding`` says when it paused (``Yielding.paused``, ``pauses``).
    """

    def __init__(self, engine: Any, *, name: str = "MODEL", texts: Sequence[str] | None = None, plan: FitPlan = FitPlan(),
                 start_after_s: float = 10.0, quiet_s: float = 0.5) -> None:  # fmt: skip
        self._engine = weakref.proxy(engine)
        self.name = name
        self.texts = texts
        self.plan = plan
        self.start_after_s = start_after_s
        self.profile: Profile | None = None
        self.weights_refined = False
        self.done = threading.Event()
        self._stop = threading.Event()
        self.yielding = Yielding(engine.writer.turns, self._stop, quiet_s=quiet_s, device=engine.model.device)
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="cachegen-profile", daemon=True)
        stop_at_exit(self)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the fitter to stop after its current model call, and wait for it."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def quiet_s(self) -> float:
        """How long no request must have computed before the fit goes on after one."""
        return self.yielding.quiet_s

    @quiet_s.setter
    def quiet_s(self, seconds: float) -> None:
        self.yielding.quiet_s = seconds

    def _guard(self) -> AbstractContextManager[None]:
        """Hold the engine's model lock for one model call, let go whenever a request computes."""
        return self.yielding.holding(self._engine.scheduler.lock)

    def _wait_start(self) -> None:
        """Until the engine has answered a request, or ``start_after_s`` has passed."""
        while not self._engine.metrics_recorder.snapshot() and time.monotonic() - self._started < self.start_after_s:
            if self._stop.wait(0.1):
                raise Stopped

    def _refine_weights(self) -> None:
        """Scale the step weights the engine codes with, without a profile, by each layer's measured sensitivity
        (``codec.fitting.weights_by_layer``) for the rest of its life: its chunks hold the same bits at a lower KL
        from then on (``docs/results.md``, "Without a profile"); keys and decoding do not change. Nothing to do
        when it codes with plain steps; logged, and left as it was, when the measurement fails."""
        e = self._engine
        base = e.codec.step_weights
        if base is None:
            return
        t0 = time.perf_counter()
        try:
            weights = weights_by_layer(e.model, e.tokenizer, base, self.texts[0] if self.texts else None, e.codec.config,
                                       rotary=RotarySpec.from_model(e.model), guard=self._guard)  # fmt: skip
            e.codec.step_weights = check_weights(weights)
        except MEASURE_ERRORS as err:
            log.warning("could not measure each layer's sensitivity of %s (%s): its steps stay as they were", self.name, err)
            return
        self.weights_refined = True
        log.info("measured each layer's sensitivity of %s in %.0f s: steps without a profile weighted by it from now on",
                 self.name, time.perf_counter() - t0)  # fmt: skip

    def _run(self) -> None:
        try:
            self._wait_start()
            t0 = time.perf_counter()
            e = self._engine
            config, store, model = e.codec.config, e.store, e.model
            fp = e.fingerprint
            with self.yielding.active():
                self._refine_weights()
                profile = fit_profile(model, e.tokenizer, self.texts, config, plan=self.plan, fingerprint=fp,
                                      rotary=RotarySpec.from_model(model), guard=self._guard,
                                      identity=model_identity(model, e.tokenizer))  # fmt: skip
            self.profile = publish(store, profile, config, model)
            how = "fitted" if self.profile.id == profile.id else "fitted, but another process published one first:"
            log.warning("profile %s %s in %.0f s, published in the store as %s: engines started from now on code with it "
                        "(this one keeps coding without, so its chunk keys do not change)", self.profile.id, how,
                        time.perf_counter() - t0, profile_key(fp, config.codec_id))  # fmt: skip
        except (Stopped, ReferenceError):
            pass
        except (CacheGenError, StoreError, RuntimeError, ValueError, OSError) as e:
            log.warning("fitting a profile for %s in the background failed: %s", self.name, e)
        finally:
            self.done.set()


def measure_weights(engine: Any, *, name: str = "MODEL") -> bool:
    """Give ``engine``'s codec (without a profile) step weights measured on its model (``codec.fitting.fit_weights``:
    one short Fisher draw, holding the model lock); False, logged, when they cannot be measured (plain steps then)."""
    t0 = time.perf_counter()
    try:
        with engine.scheduler.exclusive():
            weights = fit_weights(engine.model, engine.tokenizer, config=engine.codec.config, rotary=RotarySpec.from_model(engine.model))
        engine.codec.step_weights = check_weights(weights)
    except MEASURE_ERRORS as e:
        log.warning("could not measure the sensitivity of %s (%s): coding without a profile with plain steps", name, e)
        return False
    log.info("measured the sensitivity of %s in %.1f s: steps weighted by it until a profile is used", name, time.perf_counter() - t0)
    return True


def start_fitting(engine: Any, *, name: str = "MODEL") -> ProfileFitter:
    """Log that ``engine`` codes without a profile and start a ``ProfileFitter`` for it."""
    how = "its steps weighted by the model's measured sensitivity" if engine.codec.step_weights is not None else "plain steps"
    log.warning("no codec profile for %s: coding without one (%s; larger chunks) while one is fitted in the background "
                "on the shipped calibration text (`cachegen profile --model %s` fits one on your own texts)", name, how, name)  # fmt: skip
    return ProfileFitter(engine, name=name)
