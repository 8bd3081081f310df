"""Peer parity: greedy `LLM.generate` on a transformers-made Kimi-Linear checkpoint equals transformers' `generate`, token for
token, for a batch of different-length prompts, with and without chunked prefill."""

from pathlib import Path

import pytest
import torch

from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

pytest.importorskip("transformers", minversion="5.24", reason="transformers>=5.24 (native kimi_linear) is a test dependency")

NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        linear_head_dim=16, linear_num_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger than the default init so that greedy choices are not near-ties
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")) and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    path = tmp_path_factory.mktemp("hf") / "kimi_linear"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected(checkpoint) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import KimiLinearForCausalLM

    ref = KimiLinearForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # always NEW tokens, so the whole length is compared
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 211, (n,), generator=g).tolist() for n in (9, 1, 30, 17)]
    outs = []
    with torch.no_grad():
        for p in prompts:
            outs.append(ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p) :].tolist())
    return prompts, outs


@pytest.mark.slow  # transformers import and its reference generate take ~15 s of CPU
@pytest.mark.parametrize("chunk", [None, 5])
def test_llm_generate_equals_transformers_generate(checkpoint, expected, chunk) -> None:
    prompts, want = expected
    llm = LLM(str(checkpoint), ByteTokenizer(256), num_pages=64, page_size=4, max_num_seqs=4, max_model_len=64, long_prefill_token_threshold=chunk)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == want
    llm.engine.check_integrity()
