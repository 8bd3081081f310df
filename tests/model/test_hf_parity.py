"""Peer parity with transformers' native Kimi-Linear (a test dependency only): a small random model saved with
`save_pretrained` loads with `openk3.model.load_model` and gives the same logits and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openk3.model import CacheTensors, ForwardBatch, load_model

transformers = pytest.importorskip("transformers", minversion="5.24", reason="transformers>=5.24 (native kimi_linear) is a test dependency")


def make_hf_model(tmp_path: Path, q_lora_rank: int | None) -> Path:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=24,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_head_dim=16,
        linear_num_heads=3,
        routed_scaling_factor=2.446,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # transformers initialises with std 0.02, which makes every logit nearly equal; larger weights make the comparison bite
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")) and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    path = tmp_path / "kimi_linear_tiny"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[None, 24], ids=["q_full_rank", "q_lora"])
def checkpoint(request, tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), request.param)


def test_logits_match_transformers(checkpoint: Path) -> None:
    from transformers import KimiLinearForCausalLM

    ref = KimiLinearForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = load_model(checkpoint, dtype=torch.float32)
    tokens = torch.randint(3, 211, (2, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours.forward_tokens(tokens)
    assert (got - expected).abs().max().item() < 1e-4


def greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=32, page_size=8)
    table = torch.arange(32).view(1, 32)
    out, tokens, ctx = [], prompt, 0
    with torch.no_grad():
        for _ in range(n):
            logits = model(ForwardBatch.for_step([tokens], [ctx], [0], table), cache)
            ctx += len(tokens)
            tokens = [int(logits[0].argmax())]
            out.append(tokens[0])
    return out


def test_greedy_tokens_match_transformers_generate(checkpoint: Path) -> None:
    from transformers import KimiLinearForCausalLM

    ref = KimiLinearForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = load_model(checkpoint, dtype=torch.float32)
    prompt = torch.randint(3, 211, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # no EOS: 32 tokens always, so that the comparison covers the whole length
        ref.generation_config.eos_token_id = None
        expected = ref.generate(prompt, max_new_tokens=32, do_sample=False)[0, 11:].tolist()
    assert len(expected) == 32
    assert greedy(ours, prompt[0].tolist(), 32) == expected
