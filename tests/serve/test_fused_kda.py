"""The served KDA layer (serve/fused_kda.py) beside the served MoE and MLA layers (serve/fused_moe.py, serve/fused_mla.py): an
engine on CPU with packed weights runs each KDA layer's decode token, each latent MoE layer's decode step and each MLA
layer's decode inputs as one C call, and gives the same
tokens and logprobs as the same engine with the layers' own forwards, also after in-place weight writes (the weights the
one calls keep are checked against the parameters' versions); prefill steps and other ops run the layer's own forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import LatentMoE
from openk3.ops.cpu.build import kernels_available
from openk3.serve.fused_kda import ServedKDA
from openk3.serve.fused_mla import ServedMLA
from openk3.serve.fused_moe import ServedLatentMoE
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.model.conftest import build

pytestmark = [pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here"), pytest.mark.usefixtures("one_torch_thread")]
PROMPTS = [[5, 9, 33, 7, 100, 2, 8], [41, 42, 43], [200, 1, 77, 77, 3, 19, 64, 12, 90, 4, 6]]
TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)


def counted(fn: Callable[..., torch.Tensor], calls: list[int]) -> Callable[..., torch.Tensor]:
    def call(*args: Any) -> torch.Tensor:
        calls.append(1)
        return fn(*args)

    return call


def run(llm: LLM) -> list[tuple[Any, Any]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS)]


def test_one_call_layers_give_the_engines_own_tokens_and_logprobs() -> None:
    model = build(debug())
    model.quantize_experts()
    llm = LLM(model, ByteTokenizer(256), page_size=4, num_pages=64, max_num_seqs=4, pack_cpu_weights=True)
    try:
        served = cast(torch.nn.Module, llm.engine.runner.model)
        kda = [cast(ServedKDA, m) for m in served.modules() if isinstance(m, KimiDeltaAttention)]
        moe = [m for m in served.modules() if isinstance(m, LatentMoE)]
        mla = [m for m in served.modules() if isinstance(m, GatedMLA)]
        assert kda and moe and mla and all(type(m) is ServedKDA for m in kda) and all(type(m) is ServedLatentMoE for m in moe)
        assert all(type(m) is ServedMLA for m in mla)
        calls: list[int] = []
        for m in kda:
            m.layer_decode = counted(m.layer_decode, calls)
        fused = run(llm)
        assert len(calls) >= len(kda) * (TOKENS - 1)  # every decode step of every KDA layer
        with torch.no_grad():  # in-place writes: the weights the one calls found before must not be used again
            for m in kda:
                m.o_proj.weight.mul_(1.5)
                m.q_proj.weight.mul_(0.5)
                m.A_log.add_(0.25)
            for layer in moe:
                layer.routed_expert_up_proj.weight.mul_(1.5)
            for attn in mla:
                attn.q_b_proj.weight.mul_(1.5)
                attn.kv_a_layernorm.weight.mul_(0.5)
        written = run(llm)
        assert written != fused
        for m in kda:
            m.__class__ = KimiDeltaAttention  # type: ignore[assignment]
        for layer in moe:
            layer.__class__ = LatentMoE  # type: ignore[assignment]
        for attn in mla:
            attn.__class__ = GatedMLA  # type: ignore[assignment]
        assert run(llm) == written
    finally:
        llm.close()
