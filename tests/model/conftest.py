from __future__ import annotations

import pytest
import torch

from openk3.config import ModelConfig, debug
from openk3.model import K3ForCausalLM


def build(config: ModelConfig, seed: int = 0) -> K3ForCausalLM:
    model = K3ForCausalLM(config)
    model.init_weights(seed=seed, std=0.1)
    # non-zero AttnRes queries and router bias, so that those paths are exercised (zero is their init value)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.copy_(torch.randn(moe.gate.e_score_correction_bias.shape, generator=g) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def debug_model() -> K3ForCausalLM:
    return build(debug())
