"""The K3 EAGLE-3 head with one NoPE gated-MLA layer (model/eagle3_mla.py, model/eagle3_mla_load.py) from a small folder
in TorchSpec's Kimi-K3 draft layout with random weights: the first two drafts equal a hand-written fp32 forward (NoPE MLA
expanded head by head, the output gate, the SiTU MLP; the second through the head's own output), greedy output equals
plain decoding (prefix caching, preemption, a batch mix), the entry points pick the head by architecture, and the loader
places every tensor or names the one it cannot, and refuses the RoPE variants by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.batch import ForwardBatch
from openk3.model.checkpoint import CheckpointError
from openk3.model.eagle3_mla import Eagle3MLAHead
from openk3.model.eagle3_mla_load import load_any_eagle3
from openk3.model.model import OpChoice
from openk3.serve.eagle3_draft import Eagle3Proposer
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.speculative import SpeculativeConfig, propose_drafts
from openk3.serve.tokenizer import ByteTokenizer
from tests.model.conftest import build
from tests.model.eagle3_folder import write_head
from tests.model.eagle3_mla_folder import mla_head_config, mla_head_tensors
from tests.serve.test_eagle3 import BASE, GREEDY, PROMPTS, draft_of, rms, run

AUX = [1, 2, 4]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    return build(debug())


@pytest.fixture(scope="module")
def folder(target: K3ForCausalLM, tmp_path_factory) -> Path:
    cfg = mla_head_config(target.config, 120, AUX)
    return write_head(tmp_path_factory.mktemp("eagle3_mla") / "head", cfg, mla_head_tensors(target.config, cfg))


def situ(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)


def reference_head(t: dict[str, torch.Tensor], cfg: dict[str, Any], embed: torch.Tensor, tokens: list[int], hidden_TH: torch.Tensor) -> torch.Tensor:
    """x [T, H] by hand over one sequence from position 0: K/V expanded from the latent head by head, no rotation."""
    eps, n, kr = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    a = "layers.0.self_attn."
    x2 = torch.cat([rms(embed[torch.tensor(tokens)], t["layers.0.input_layernorm.weight"], eps), rms(hidden_TH, t["layers.0.hidden_norm.weight"], eps)], -1)
    T = len(tokens)
    q = (rms(x2 @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], eps) @ t[a + "q_b_proj.weight"].T).view(T, n, dn + dr)
    kv_a = x2 @ t[a + "kv_a_proj_with_mqa.weight"].T
    c, kpe = rms(kv_a[:, :kr], t[a + "kv_a_layernorm.weight"], eps), kv_a[:, kr:]
    kv = (c @ t[a + "kv_b_proj.weight"].T).view(T, n, dn + dv)
    out = torch.zeros(T, n, dv)
    for h in range(n):
        for p in range(T):
            s = torch.stack([(q[p, h, :dn] @ kv[j, h, :dn] + q[p, h, dn:] @ kpe[j]) / math.sqrt(dn + dr) for j in range(p + 1)])
            out[p, h] = torch.softmax(s, 0) @ kv[: p + 1, h, dn:]
    gated = out.reshape(T, n * dv) * torch.sigmoid(x2 @ t[a + "g_proj.weight"].T)
    x = hidden_TH + gated @ t[a + "o_proj.weight"].T
    m = rms(x, t["layers.0.post_attention_layernorm.weight"], eps)
    return x + situ(m @ t["layers.0.mlp.gate_proj.weight"].T, m @ t["layers.0.mlp.up_proj.weight"].T) @ t["layers.0.mlp.down_proj.weight"].T


def test_the_first_drafts_equal_a_hand_written_forward_of_the_head(target: K3ForCausalLM, folder: Path) -> None:
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    t = load_file(str(folder / "model.safetensors"))
    head = load_any_eagle3(folder, target)
    assert isinstance(head, Eagle3MLAHead)
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), speculative=SpeculativeConfig(2), eagle3_head=head)
    prompt = [7, 200, 12, 5, 99, 41, 8, 250, 3, 17, 64, 2, 90, 33, 11, 6, 120, 4, 71]  # two prefill chunks of 16 and 3
    engine.add_request("r", prompt, GREEDY)
    while not engine.scheduler.requests["r"].num_output_tokens:
        engine.step()
    req = engine.scheduler.requests["r"]
    assert isinstance(engine.proposer, Eagle3Proposer)
    propose_drafts(engine.proposer, SpeculativeConfig(2), engine.scheduler.running, engine.max_model_len, engine.runner.sampler.grammars, 256)
    tokens = req.token_ids
    naive = OpChoice(kda="naive", conv="naive", mla="naive", mla_decode="naive", moe="naive", attn_res="naive", linear="naive", norm="naive", route="naive")
    target.select_ops(naive)
    try:
        with torch.no_grad():
            _, aux = target.aux_hidden_states(ForwardBatch.from_tokens(torch.tensor([tokens[:-1]])), None, tuple(AUX))
            embed = target.model.embed_tokens.weight
            g = aux @ t["fc.weight"].T
            x1 = reference_head(t, cfg, embed, tokens[1:], g)
            first, margin1 = draft_of(t, cfg, x1[-1])
            x2 = reference_head(t, cfg, embed, tokens[1:] + [first], torch.cat([g, x1[-1:]]))
            second, margin2 = draft_of(t, cfg, x2[-1])
    finally:
        target.select_ops(OpChoice())
    torch.testing.assert_close(engine.proposer._seen["r"].last_x, x1[-1], atol=1e-4, rtol=1e-4)
    assert min(margin1, margin2) > 1e-3
    assert req.draft_token_ids == [first, second]


def agreeing_head(target: K3ForCausalLM, tmp_path: Path, outputs: list[list[int]]) -> Eagle3MLAHead:
    """A random head whose draft vocabulary is one token, the target's most frequent greedy one: verifications both
    accept and reject."""
    cfg = mla_head_config(target.config, 1, AUX)
    t = mla_head_tensors(target.config, cfg)
    common = max(set(sum(outputs, [])), key=lambda x: sum(o.count(x) for o in outputs))
    t["d2t"] = torch.tensor([common])
    t["t2d"] = torch.zeros(256, dtype=torch.bool).index_fill_(0, torch.tensor([common]), True)
    head = load_any_eagle3(write_head(tmp_path / "agreeing", cfg, t), target)
    assert isinstance(head, Eagle3MLAHead)
    return head


@pytest.mark.parametrize(
    "cfg",
    [dict(enable_prefix_caching=True, prefix_match_unit=8), dict(num_pages=20, max_num_batched_tokens=10, max_model_len=60)],
    ids=["prefix-cache", "preemption"],
)
def test_greedy_equals_plain_decoding(target: K3ForCausalLM, folder: Path, tmp_path: Path, cfg: dict) -> None:
    params = [GREEDY] * len(PROMPTS)
    want, _ = run(target, None, PROMPTS, params, **cfg)
    for head in (load_any_eagle3(folder, target), agreeing_head(target, tmp_path, want)):
        got, engine = run(target, head, PROMPTS, params, **cfg)  # type: ignore[arg-type]
        assert got == want
        stats = engine.spec_stats
        assert stats is not None and stats.num_draft_tokens > 0
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if "max_num_batched_tokens" in cfg:
        assert engine.scheduler.num_preemptions_total > 0


def test_llm_picks_the_mla_head_by_its_architecture(target: K3ForCausalLM, folder: Path) -> None:
    prompt = [5, 9, 2, 77, 31]
    small: dict[str, Any] = dict(num_pages=64, page_size=4, max_num_seqs=2, max_model_len=64)
    with LLM(target, ByteTokenizer(256), **small) as plain:
        want = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with LLM(target, ByteTokenizer(256), **small, speculative_method="eagle3", speculative_model=str(folder), num_speculative_tokens=2) as spec:
        got = spec.generate(prompt, GREEDY)[0].outputs[0].token_ids
        proposer = spec.engine.proposer
        assert isinstance(proposer, Eagle3Proposer) and isinstance(proposer.head, Eagle3MLAHead)
    assert got == want


def load(target: K3ForCausalLM, tmp_path: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    return load_any_eagle3(write_head(tmp_path / "h", cfg, tensors), target)


def test_the_loader_reads_model_prefixed_names_fc_norm_and_the_yarn_scale(target: K3ForCausalLM, tmp_path: Path) -> None:
    """NeMo's `model.`-prefixed names, fc_norm's per-chunk norms (each one used: the fused rows change with it), SiLU, no
    gate, and a yarn rope_scaling that changes only the softmax scale (DeepSeek-V3's mscale^2)."""
    yarn = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = mla_head_config(target.config, 256, AUX, fc_norm=True, hidden_act="silu", mla_use_output_gate=False, rope_scaling=yarn)
    t = mla_head_tensors(target.config, cfg)
    t = {("model." + n if n.startswith(("layers.", "fc", "norm")) else n): x for n, x in t.items()}
    head = load(target, tmp_path, cfg, t)
    assert isinstance(head, Eagle3MLAHead) and head.fc_norm is not None and head.midlayer.self_attn.output_gate is False
    assert head.midlayer.self_attn.scale == pytest.approx((0.1 * math.log(32.0) + 1) ** 2 / math.sqrt(18))
    torch.testing.assert_close(head.fc_norm[2].weight, t["model.fc_norm.2.weight"])
    aux = torch.randn(2, 3 * target.config.hidden_size)
    normed = torch.cat([rms(part, t[f"model.fc_norm.{i}.weight"], 1e-5) for i, part in enumerate(aux.chunk(3, -1))], -1)
    with torch.no_grad():
        fused = head.fuse(aux)
    torch.testing.assert_close(fused, normed @ t["model.fc.weight"].T, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused, aux @ t["model.fc.weight"].T, atol=1e-3)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(architectures=["Eagle3DeepseekV2SWAForCausalLM"]), "sliding-window"),
        (dict(mla_use_nope=False), "mla_use_nope=False"),
        (dict(num_key_value_heads=1), "num_key_value_heads=1"),
        (dict(mla_use_output_gate=False), "g_proj.weight: not part of"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(sliding_window=2048), "['sliding_window']"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(vocab_size=300), "vocab_size=300"),
    ],
)
def test_the_loader_refuses_by_name(target: K3ForCausalLM, tmp_path: Path, change: dict[str, Any], message: str) -> None:
    base = mla_head_config(target.config, 120, AUX)
    tensors = mla_head_tensors(target.config, base)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load(target, tmp_path, base | change, tensors)


def test_a_missing_or_misshapen_tensor_is_named(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = mla_head_config(target.config, 120, AUX)
    t = mla_head_tensors(target.config, cfg)
    del t["layers.0.self_attn.kv_a_layernorm.weight"]
    t["layers.0.self_attn.kv_b_proj.weight"] = t["layers.0.self_attn.kv_b_proj.weight"][:-1]
    with pytest.raises(CheckpointError, match=r"midlayer.self_attn.kv_a_layernorm.weight: missing.*kv_b_proj.weight: shape \(65, 20\)"):
        load(target, tmp_path, cfg, t)
