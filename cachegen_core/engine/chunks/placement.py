"""Where a reader decodes compressed chunks: the model's device when the coder has a decoder there that runs,
else the CPU (the KV then copied to the model's device), never silently: the reason is returned (the engine logs
it once), a decoder that fails at run time is dropped for the CPU (logged once, said in the next request's
errors), and every request's ``GenerationInfo.decode_device`` says where its chunks were decoded."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ...coders import get_decoder
from ...errors import BackendUnavailable
from ...streaming import RAW_OPTIONS, TEXT, Option
from ..serving.info import GenerationInfo

log = logging.getLogger("cachegen_core.engine")


class DecodePlacement:
    """The device a reader decodes levels of coder ``coder`` on (``device``, the CPU until ``use`` says otherwise;
    ``coder`` None: no entropy coder runs here, so no level is decoded anywhere)."""

    def __init__(self, coder: str | None) -> None:
        self.coder = coder
        self.device = torch.device("cpu")
        self._fell_back: str | None = None  # a failure not yet reported in a request

    def use(self, device: torch.device) -> str | None:
        """Decode on ``device`` when the coder has a decoder there that can run, else on the CPU; returns why not."""
        if self.coder is None:
            return None
        if device.type != "cpu":
            try:
                get_decoder(self.coder, device)
            except (BackendUnavailable, KeyError) as e:
                self.device = torch.device("cpu")
                return str(e)
        self.device = device
        return None

    def fall_back(self, e: BackendUnavailable) -> None:
        """The device's decoder failed to run (a kernel that does not compile or launch there): the CPU from now on."""
        self._fell_back = f"decoding on {self.device} failed, decoding on the CPU from now on: {e}"
        log.warning("%s", self._fell_back)
        self.device = torch.device("cpu")

    def note(self, info: GenerationInfo, options: Sequence[Option]) -> None:
        """Say in ``info`` where the levels among ``options`` (a request's streamed chunks) were decoded, and a
        fall-back to the CPU since the last request."""
        if any(o not in RAW_OPTIONS and o != TEXT for o in options):
            info.decode_device = str(self.device)
        if self._fell_back is not None:
            info.errors.append(self._fell_back)
            self._fell_back = None
