"""Attention Residuals: one-shot definition (naive) and the exact two-phase evaluation."""

from openk3.ops.attn_res.naive import attn_res
from openk3.ops.attn_res.two_phase import BlockPartial, attn_res_merge, attn_res_phase1

__all__ = ["BlockPartial", "attn_res", "attn_res_merge", "attn_res_phase1"]
