"""AttnRes "sized" (the "auto" form): the two-phase stream for steps of TWO_PHASE_MIN_TOKENS tokens and more, the one-shot
stream below (ops/thresholds.py has the measurement: decode-sized steps are op-count bound, where phase 1 does not pay)."""

from __future__ import annotations

import torch

from openk3.ops.attn_res.naive import OneShotStream
from openk3.ops.attn_res.stream import DepthStream
from openk3.ops.attn_res.two_phase import TwoPhaseStream
from openk3.ops.thresholds import TWO_PHASE_MIN_TOKENS  # this module's own name, so a test can move the switch


def attn_res_sized(embed_TD: torch.Tensor) -> DepthStream:
    if embed_TD.shape[0] >= TWO_PHASE_MIN_TOKENS:
        return TwoPhaseStream(embed_TD)
    return OneShotStream(embed_TD)
