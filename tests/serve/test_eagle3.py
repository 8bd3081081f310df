"""Speculative decoding with an EAGLE-3 head (model/eagle3.py, serve/eagle3_draft.py) on a small target and a head folder
in the published layout with random weights: the first two drafts equal a hand-written fp32 forward of the head over the
target's aux hidden states (the second through the head's own output, as a chain of k > 1 does); greedy output equals
plain decoding token for token (several prompts, batch mixes with sampled and logprob requests, chunked prefill, prefix
caching, preemption); the spec_decode counters count; the entry points (LLM, --speculative-config) build it."""

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
from openk3.model.eagle3 import Eagle3Head
from openk3.model.eagle3_load import load_eagle3
from openk3.model.model import OpChoice
from openk3.serve.eagle3_draft import Eagle3Proposer
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.speculative import SpeculativeConfig, propose_drafts
from openk3.serve.tokenizer import ByteTokenizer
from tests.model.conftest import build
from tests.model.eagle3_folder import head_config, head_tensors, write_head

BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=128, long_prefill_token_threshold=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(40, 70)), list(range(40, 70)) + [9, 8, 7], [5, 6, 7, 8] * 5, [100, 3, 77]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    return build(debug())


@pytest.fixture(scope="module")
def folder(target: K3ForCausalLM, tmp_path_factory) -> Path:
    cfg = head_config(target.config, 120, [1, 2, 4])
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", cfg, head_tensors(target.config, cfg))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x_TND: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE at positions 0 .. T - 1, pair by pair."""
    t, _, d = x_TND.shape
    out = x_TND.clone()
    for p in range(t):
        for i in range(d // 2):
            a = p / theta ** (2 * i / d)
            x1, x2 = x_TND[p, :, i], x_TND[p, :, i + d // 2]
            out[p, :, i], out[p, :, i + d // 2] = x1 * math.cos(a) - x2 * math.sin(a), x2 * math.cos(a) + x1 * math.sin(a)
    return out


def reference_head(t: dict[str, torch.Tensor], cfg: dict[str, Any], embed: torch.Tensor, tokens: list[int], hidden_TH: torch.Tensor) -> torch.Tensor:
    """x [T, H] by hand over one sequence from position 0: row p reads token tokens[p] and hidden_TH[p] (fc(aux) or a
    chained x), causal softmax attention head by head, key/value heads shared by groups."""
    eps, n, g = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // n
    x2 = torch.cat([rms(embed[torch.tensor(tokens)], t["midlayer.input_layernorm.weight"], eps), rms(hidden_TH, t["midlayer.hidden_norm.weight"], eps)], -1)
    T = len(tokens)
    q = rope((x2 @ t["midlayer.self_attn.q_proj.weight"].T).view(T, n, d), cfg["rope_theta"])
    k = rope((x2 @ t["midlayer.self_attn.k_proj.weight"].T).view(T, g, d), cfg["rope_theta"])
    v = (x2 @ t["midlayer.self_attn.v_proj.weight"].T).view(T, g, d)
    out = torch.zeros(T, n, d)
    for h in range(n):
        kv = h // (n // g)
        for p in range(T):
            w = torch.softmax(k[: p + 1, kv] @ q[p, h] / math.sqrt(d), 0)
            out[p, h] = w @ v[: p + 1, kv]
    x = hidden_TH + out.reshape(T, n * d) @ t["midlayer.self_attn.o_proj.weight"].T
    m = rms(x, t["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T


def draft_of(t: dict[str, torch.Tensor], cfg: dict[str, Any], x_H: torch.Tensor) -> tuple[int, float]:
    """(the target id the head drafts from x, the margin of its draft logit over the runner-up)."""
    logits = rms(x_H, t["norm.weight"], cfg["rms_norm_eps"]) @ t["lm_head.weight"].T
    top = logits.topk(2)
    best = int(top.indices[0])
    return best + int(t["d2t"][best]), float(top.values[0] - top.values[1])


def test_the_first_drafts_equal_a_hand_written_forward_of_the_head(target: K3ForCausalLM, folder: Path) -> None:
    from safetensors.torch import load_file

    cfg = head_config(target.config, 120, [1, 2, 4])
    t = load_file(str(folder / "model.safetensors"))
    head = load_eagle3(folder, target)
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), speculative=SpeculativeConfig(2), eagle3_head=head)
    prompt = [7, 200, 12, 5, 99, 41, 8, 250, 3, 17, 64, 2, 90, 33, 11, 6, 120, 4, 71]  # two prefill chunks of 16 and 3
    engine.add_request("r", prompt, GREEDY)
    while not engine.scheduler.requests["r"].num_output_tokens:
        engine.step()
    req = engine.scheduler.requests["r"]
    assert isinstance(engine.proposer, Eagle3Proposer)
    propose_drafts(engine.proposer, SpeculativeConfig(2), engine.scheduler.running, engine.max_model_len, engine.runner.sampler.grammars, 256)
    tokens = req.token_ids  # the prompt and the first sampled token
    naive = OpChoice(kda="naive", conv="naive", mla="naive", mla_decode="naive", moe="naive", attn_res="naive", linear="naive", norm="naive", route="naive")
    target.select_ops(naive)
    try:
        with torch.no_grad():
            _, aux = target.aux_hidden_states(ForwardBatch.from_tokens(torch.tensor([tokens[:-1]])), None, (1, 2, 4))
            embed = target.model.embed_tokens.weight
            g = aux @ t["fc.weight"].T
            x1 = reference_head(t, cfg, embed, tokens[1:], g)
            first, margin1 = draft_of(t, cfg, x1[-1])
            x2 = reference_head(t, cfg, embed, tokens[1:] + [first], torch.cat([g, x1[-1:]]))
            second, margin2 = draft_of(t, cfg, x2[-1])
    finally:
        target.select_ops(OpChoice())
    torch.testing.assert_close(engine.proposer._seen["r"].last_x, x1[-1], atol=1e-4, rtol=1e-4)
    assert min(margin1, margin2) > 1e-3  # the argmaxes are not near ties
    assert req.draft_token_ids == [first, second]


def run(
    target: K3ForCausalLM, head: Eagle3Head | None, prompts: list[list[int]], params: list[SamplingParams], k: int = 3, **cfg
) -> tuple[list[list[int]], LLMEngine]:
    spec = SpeculativeConfig(k) if head is not None else None
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**{**BASE, **cfg}), speculative=spec, eagle3_head=head)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))], engine


def agreeing_head(target: K3ForCausalLM, tmp_path: Path, outputs: list[list[int]]) -> Eagle3Head:
    """A random head whose draft vocabulary is one token, the target's most frequent greedy one: it drafts that token
    always, so verifications both accept (where the target repeats it) and reject."""
    cfg = head_config(target.config, 1, [1, 2, 4])
    t = head_tensors(target.config, cfg)
    common = max(set(sum(outputs, [])), key=lambda x: sum(o.count(x) for o in outputs))
    t["d2t"] = torch.tensor([common])
    t["t2d"] = torch.zeros(256, dtype=torch.bool).index_fill_(0, torch.tensor([common]), True)
    return load_eagle3(write_head(tmp_path / "agreeing", cfg, t), target)


@pytest.mark.parametrize(
    "cfg",
    [{}, dict(enable_prefix_caching=True, prefix_match_unit=8), dict(num_pages=20, max_num_batched_tokens=10, max_model_len=60)],
    ids=["plain", "prefix-cache", "preemption"],
)
def test_greedy_equals_plain_decoding(target: K3ForCausalLM, folder: Path, tmp_path: Path, cfg: dict) -> None:
    params = [GREEDY] * len(PROMPTS)
    want, _ = run(target, None, PROMPTS, params, **cfg)
    for head in (load_eagle3(folder, target), agreeing_head(target, tmp_path, want)):
        got, engine = run(target, head, PROMPTS, params, **cfg)
        assert got == want
        stats = engine.spec_stats
        assert stats is not None and stats.num_draft_tokens > 0
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # the agreeing head: accepts and rejects
    if "max_num_batched_tokens" in cfg:
        assert engine.scheduler.num_preemptions_total > 0


def test_greedy_equals_plain_decoding_across_batch_mixes(target: K3ForCausalLM, folder: Path, tmp_path: Path) -> None:
    """Ten prompts through 4 slots, every third asking for logprobs (decoding one token a step beside the speculating
    ones), two sampled requests with seeds (their tokens are not compared), repeated prefixes for the prefix cache."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 255, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (10,), generator=g)]
    prompts[5], prompts[9] = prompts[1] + [4, 4], list(prompts[1])
    params = [GREEDY.replace(max_tokens=6 + i % 9, logprobs=1 if i % 3 == 2 else None) for i in range(10)]
    params[4] = params[7] = SamplingParams(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True)
    cfg = dict(enable_prefix_caching=True, prefix_match_unit=8)
    want, _ = run(target, None, prompts, params, **cfg)
    head = agreeing_head(target, tmp_path, want)
    for k in (2, 4):
        got, engine = run(target, head, prompts, params, k=k, **cfg)
        assert [o for i, o in enumerate(got) if i not in (4, 7)] == [o for i, o in enumerate(want) if i not in (4, 7)]
        assert len(got[4]) == len(got[7]) == 8
        stats = engine.spec_stats
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert len(stats.accepted_per_position) == k


def test_llm_and_speculative_config_build_it(target: K3ForCausalLM, folder: Path) -> None:
    prompt = [5, 9, 2, 77, 31]
    small: dict[str, Any] = dict(num_pages=64, page_size=4, max_num_seqs=2, max_model_len=64)
    with LLM(target, ByteTokenizer(256), **small) as plain:
        want = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with LLM(target, ByteTokenizer(256), **small, speculative_method="eagle3", speculative_model=str(folder), num_speculative_tokens=2) as spec:
        got = spec.generate(prompt, GREEDY)[0].outputs[0].token_ids
        stats = spec.engine.spec_stats
        assert isinstance(spec.engine.proposer, Eagle3Proposer)
    assert got == want
    assert stats is not None and stats.num_draft_tokens > 0


def test_an_aborted_request_leaves_nothing_in_the_head(target: K3ForCausalLM, folder: Path) -> None:
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), speculative=SpeculativeConfig(2), eagle3_head=load_eagle3(folder, target))
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[3], GREEDY)
    for _ in range(3):
        engine.step()
    proposer = engine.proposer
    assert isinstance(proposer, Eagle3Proposer) and sorted(proposer._seen) == ["a", "b"]
    engine.abort("a")
    engine.abort("b")
    assert not proposer._seen


def test_the_shipped_head_drafts_for_the_demo_model() -> None:
    """openk3/assets/tiny/eagle3 (trained by `openk3 train-eagle3`): greedy output equal to plain decoding, and most
    drafts accepted on a held-out KJV chapter's opening (its MODEL_CARD.md: 0.74 at k = 2 over 23 chapters)."""
    from openk3.train.data import kjv_chapters, split_documents

    small: dict[str, Any] = dict(max_num_seqs=1, max_model_len=96, num_pages=8, page_size=16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM("tiny", dtype="float32", **small) as plain:
        prompt = plain.tokenizer.encode(split_documents(kjv_chapters())[1][0])[:32]
        want = plain.generate(prompt, params)[0].outputs[0].token_ids
    with LLM("tiny", dtype="float32", speculative_method="eagle3", speculative_model="tiny/eagle3", num_speculative_tokens=2, **small) as spec:
        got = spec.generate(prompt, params)[0].outputs[0].token_ids
        stats = spec.engine.spec_stats
    assert got == want
    assert stats is not None and stats.acceptance_rate > 0.4


def test_requests_with_a_grammar_draft_inside_it(target: K3ForCausalLM, folder: Path) -> None:
    """A JSON-schema request beside a free one: the head's drafts for it are drawn over the target's vocabulary under
    the grammar's mask (serve/draft_steering.py), and greedy output is plain decoding's."""
    pytest.importorskip("xgrammar", reason="the grammar engine")
    from openk3.serve.structured.compiler import GrammarCompiler
    from openk3.serve.structured.spec import StructuredOutputs

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"]}
    grammar = GrammarCompiler(ByteTokenizer(256), 256).compile(StructuredOutputs(json=json.dumps(schema)))
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=grammar, stop_token_ids=(255,)), GREEDY]
    prompts = [[9, 40, 41, 42, 43] * 3, [5, 6, 7, 8] * 4]
    plain, _ = run(target, None, prompts, params)
    spec, engine = run(target, load_eagle3(folder, target), prompts, params)
    assert spec == plain
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0
