"""Attention Residuals: the one-shot definition (naive) and the exact two-phase evaluation, each also as the residual
stream a layer loop reads (stream.py; "attn_res" in ops/registry.py: naive, fast, sized)."""

from openk3.ops.attn_res.naive import OneShotStream, attn_res
from openk3.ops.attn_res.sized import attn_res_sized
from openk3.ops.attn_res.stream import DepthStream, MixQuery
from openk3.ops.attn_res.two_phase import BlockPartial, TwoPhaseStream, attn_res_merge, attn_res_phase1

__all__ = ["BlockPartial", "DepthStream", "MixQuery", "OneShotStream", "TwoPhaseStream", "attn_res", "attn_res_merge", "attn_res_phase1", "attn_res_sized"]
