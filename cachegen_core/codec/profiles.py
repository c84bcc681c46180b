"""Where profiles are found: fitted ones in the user cache, shipped ones in the package.

- ``<cache>/profiles/<fingerprint>-<codec id>.safetensors``: written by ``cachegen profile``
  (fitted on the user's own contexts), found first;
- ``cachegen_core/profiles/*.safetensors``: package data, the reference model's profile fitted
  on the dev transcripts (``cachegen_core/profiles/README.md``), so a fresh install codes with
  one.

A profile of the same model fitted for another codec configuration (an older build, another
``CodecConfig``) or in an older file format is never used, and never silently: ``find_profile``
logs it once, with the command that refits it (``stale_profiles``). A profile records the identity
of the model it was fitted on (``keys.fingerprint.model_identity``): ``family_profiles`` finds the
candidates for the same model loaded in another dtype, whose fingerprint differs.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from ..errors import CacheGenFormatError
from ..paths import cache_dir
from .config import CodecConfig
from .profile import IDENTITY_KEY, PROFILE_FORMAT, Profile

log = logging.getLogger(__name__)
#: The package's shipped profiles (package data).
SHIPPED = Path(__file__).resolve().parent.parent / "profiles"
_reported: set[str] = set()
_lock = threading.Lock()


def profile_dir() -> Path:
    """Where fitted profiles live: ``profiles`` in the package's cache directory, beside the converted models."""
    return cache_dir("profiles")


def default_profile_path(model_fingerprint: str, config: CodecConfig) -> Path:
    """The profile path of a model under a codec configuration (found again by fingerprint)."""
    return profile_dir() / f"{model_fingerprint[:32]}-{config.codec_id}.safetensors"


def refit_command(model: str = "MODEL") -> str:
    """The command that fits a profile for ``model`` on the calibration text shipped with the package."""
    return f"cachegen profile --model {model}"


def find_profile(model_fingerprint: str, config: CodecConfig, *, model: str = "MODEL") -> Profile | None:
    """The profile of this model and codec: the user cache's, else a shipped one, else None. A file of this
    model that cannot be used (damaged, another codec or format: ``stale_profiles``) is reported once, and
    skipped; ``model`` names the model in that report's refit command."""
    path = default_profile_path(model_fingerprint, config)
    candidates = [path] if path.exists() else []
    candidates += sorted(SHIPPED.glob(f"{model_fingerprint[:32]}-{config.codec_id}.safetensors"))
    for p in candidates:
        try:
            profile = Profile.load(p)
            if profile.model_fingerprint != model_fingerprint or profile.codec_id != config.codec_id:
                raise CacheGenFormatError("it names another model or codec than its file name")
            profile.origin = "the user cache" if p == path else "shipped with the package"
            return profile
        except CacheGenFormatError as e:
            _report(p, str(e), model)
    for p, why in stale_profiles(model_fingerprint, config):
        _report(p, why, model)
    return None


def stale_profiles(model_fingerprint: str, config: CodecConfig) -> list[tuple[Path, str]]:
    """Profile files of this model for another codec id or format, and why this codec cannot use them."""
    out = []
    for d in (profile_dir(), SHIPPED):
        for p in sorted(d.glob(f"{model_fingerprint[:32]}-*.safetensors")) if d.is_dir() else ():
            if p.name == f"{model_fingerprint[:32]}-{config.codec_id}.safetensors":
                continue
            out.append((p, _why(p, config)))
    return out


def read_meta(path: Path) -> dict | None:
    """A profile file's metadata, read from its header alone (None: not readable as a profile's)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(json.loads(f.read(min(n, 1 << 24)))["__metadata__"]["cachegen_profile"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def family_profiles(family: str, config: CodecConfig) -> list[tuple[Path, dict]]:
    """The profile files for this codec (the user cache's, then the shipped ones) fitted on a model of ``family``
    (``keys.fingerprint.model_family``, whatever its dtype), with their metadata: candidates for a model that has
    no profile of its own fingerprint (the caller checks the weights they record, ``keys.fingerprint.same_model``)."""
    out = []
    for d in (profile_dir(), SHIPPED):
        for p in sorted(d.glob(f"*-{config.codec_id}.safetensors")) if d.is_dir() else ():
            meta = read_meta(p)
            identity = meta.get(IDENTITY_KEY) if meta is not None else None
            if isinstance(identity, dict) and identity.get("family") == family:
                out.append((p, meta))
    return out


def _why(path: Path, config: CodecConfig) -> str:
    """Why a profile file of this model does not apply, read from its metadata alone."""
    meta = read_meta(path)
    if meta is None:
        return "it cannot be read"
    if meta.get("format") != PROFILE_FORMAT:
        return f"it is a {meta.get('format')!r} file (this build reads {PROFILE_FORMAT})"
    return f"it was fitted for codec {meta.get('codec_id')!r}, this codec is {config.codec_id}"


def _report(path: Path, why: str, model: str) -> None:
    with _lock:
        if str(path) in _reported:
            return
        _reported.add(str(path))
    log.warning("profile %s is not used: %s. Refit it with `%s` (or on your own contexts: --texts FILE.jsonl)",
                path, why, refit_command(model))  # fmt: skip
