"""Kimi Delta Attention ops. Prefill is chosen by name through ops/registry.py ("kda_prefill": naive = the per-token
definition, fast = chunkwise in place, autograd = chunkwise differentiable); decode (one token per sequence) is kda_decode
(the definition's order) or kda_decode_ (in place, the state read once), and kda_mixed splits a mixed serving step between
decode and prefill; the KDA layer picks among them."""

from __future__ import annotations

from openk3.ops.kda.chunk import kda_chunk
from openk3.ops.kda.decode import kda_decode
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.gate import kda_gate
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.kda.naive import kda_recurrent

__all__ = ["kda_chunk", "kda_decode", "kda_decode_", "kda_gate", "kda_mixed", "kda_recurrent"]
