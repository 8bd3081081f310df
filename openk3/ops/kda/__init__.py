"""Kimi Delta Attention ops, chosen by name through ops/registry.py. Prefill ("kda_prefill", one signature: naive.py's
kda_recurrent): naive = the per-token definition, fast = chunkwise in place, autograd = chunkwise differentiable, mixed =
chunkwise with the one-token sequences of a serving step sent to kda_decode, fla / fla_recurrent = fla's kernels. Decode
("kda_decode", one signature: a layer's step from its projections, decode_step.py): naive, in_pool, fused (C), fla, paired
with the prefill by the registry's "auto" rule. The building blocks: kda_decode (the definition's order), kda_decode_ (in
place, the state read once), kda_gate."""

from __future__ import annotations

from openk3.ops.kda.chunk import kda_chunk
from openk3.ops.kda.decode import kda_decode
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.gate import kda_gate
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.kda.naive import kda_recurrent

__all__ = ["kda_chunk", "kda_decode", "kda_decode_", "kda_gate", "kda_mixed", "kda_recurrent"]
