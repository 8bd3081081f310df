"""Weight sync in process: a trainer's new weights into the engine behind an `LLM`, between two generate calls (LLM is
synchronous, so nothing runs then and no answer mixes two versions). The work is parallel/weight_update.py's, shared with
the server's weight routes: names mapped (official names, dense experts quantised for an MXFP4 engine), every name and
shape checked before anything is written, copied in place, the serving layout applied again, the prefix cache rekeyed
and the weight version counted. A partial state dict (only the tensors a trainer changed) is taken.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from openk3.llm import LLM
from openk3.parallel.weight_update import update_engine_weights


def update_weights(llm: LLM, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Load `state_dict` into the engine behind `llm` in place; returns the engine's new weight version."""
    if llm.core is not llm.engine:
        raise ValueError("update_weights: a single-process engine only (not dp > 1)")
    return update_engine_weights(llm.engine, state_dict)
