"""Speculative decoding with the checkpoint's own multi-token-prediction layer (model/mtp.py, model/mtp_load.py,
serve/mtp_draft.py) on a small release-shaped folder whose MTP layer has random weights: every MTP tensor is read into the
layer (none skipped, nothing logged as skipped); the first two drafts equal a hand-written fp32 forward of the layer over
the target's hidden states (the second through the layer's own output, as a chain of k > 1 does); greedy output equals
plain decoding token for token (several prompts, batch mixes, chunked prefill, prefix caching, preemption); the entry
points (LLM, --speculative-config {"method": "mtp"}) build it, and a folder without an MTP layer is refused by name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from openk3.config import LayerKind, debug
from openk3.launch.server import server_configs
from openk3.llm import LLM
from openk3.model import CheckpointError, K3ForCausalLM, load_model
from openk3.model.batch import ForwardBatch
from openk3.model.model import OpChoice
from openk3.model.moe import DenseExperts, PackedExperts
from openk3.model.mtp import MTPLayer, mtp_block_config
from openk3.model.mtp_load import _Holder, load_mtp
from openk3.model.weights import export_state_dict
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.mtp_draft import MTPProposer
from openk3.serve.sampling import SamplingParams
from openk3.serve.speculative import SpeculativeConfig, propose_drafts
from openk3.serve.tokenizer import ByteTokenizer
from tests.model.conftest import build
from tests.model.test_release_layout import MTP_LAYER, release_tensors, write_release
from tests.serve.test_kimi_tokenizer import write_kimi_tokenizer
from tests.serve.test_speculative_flags import serve_args

PREFIX = f"language_model.model.layers.{MTP_LAYER}."
BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=128, long_prefill_token_threshold=16)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_mtp(target: K3ForCausalLM, seed: int = 3) -> dict[str, torch.Tensor]:
    """A random MTP layer (gated MLA + MXFP4 routed experts, as the release's) in the checkpoint's names; norms not 1, so
    that enorm, hnorm and shared_head.norm each matter."""
    layer = MTPLayer(mtp_block_config(target.config, LayerKind.MLA, moe=True), target.model.embed_tokens, target.lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if "norm" in name else 0.1
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
        layer.block_sparse_moe.experts = PackedExperts.from_dense(cast(DenseExperts, layer.block_sparse_moe.experts))
    out = {}
    for name, t in export_state_dict(cast(K3ForCausalLM, _Holder(layer))).items():
        out[PREFIX + name.removeprefix("model.layers.0.")] = t
        if name.endswith(".weight_packed"):
            out[PREFIX + name.removeprefix("model.layers.0.").replace("weight_packed", "weight_shape")] = torch.tensor([t.shape[0], 2 * t.shape[1]])
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[K3ForCausalLM, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("mtp")
    vocab = write_kimi_tokenizer(root / "probe")
    model = build(debug().replace(vocab_size=vocab))
    model.quantize_experts()
    mtp = random_mtp(model)
    tensors = {n: t for n, t in release_tensors(model).items() if not n.startswith(PREFIX)} | mtp
    return model, write_release(root / "k3", model, tensors), mtp


def test_every_mtp_tensor_is_read_and_none_is_logged_as_skipped(folder, caplog) -> None:
    _, path, mtp = folder
    with caplog.at_level(logging.INFO, logger="openk3.model"):
        target = load_model(path, mtp=True)
        layer = load_mtp(path, target)
    assert not [r for r in caplog.records if r.name == "openk3.model"]
    got = {PREFIX + n.removeprefix("model.layers.0."): t for n, t in export_state_dict(cast(K3ForCausalLM, _Holder(layer))).items()}
    want = {n: t for n, t in mtp.items() if not n.endswith("weight_shape")}  # checked on load, not stored
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert layer.target_parts[0] is target.model.embed_tokens and layer.target_parts[1] is target.lm_head


def test_a_folder_without_an_mtp_layer_is_refused(folder, tmp_path: Path) -> None:
    model, _, _ = folder
    tensors = {n: t for n, t in release_tensors(model).items() if not n.startswith(PREFIX)}
    path = write_release(tmp_path / "no_mtp", model, tensors, shards=1)
    with pytest.raises(CheckpointError, match="needs the checkpoint's multi-token-prediction layer; it has none"):
        load_mtp(path, load_model(path, mtp=True))


def test_an_mtp_tensor_the_layer_lacks_is_named(folder, tmp_path: Path) -> None:
    model, _, mtp = folder
    tensors = {n: t for n, t in release_tensors(model).items() if not n.startswith(PREFIX)} | mtp
    tensors[PREFIX + "self_attn.surprise"] = torch.zeros(3)
    del tensors[PREFIX + "hnorm.weight"]
    path = write_release(tmp_path / "bad_mtp", model, tensors, shards=1)
    with pytest.raises(CheckpointError) as err:
        load_mtp(path, load_model(path, mtp=True))
    assert f"unexpected tensor {PREFIX}self_attn.surprise (3,)" in str(err.value)
    assert f"missing tensor {PREFIX}hnorm.weight" in str(err.value)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp(layer: MTPLayer, target: K3ForCausalLM, tokens: list[int], hidden_TD: torch.Tensor) -> torch.Tensor:
    """The layer's outputs x [T, D] by hand, cache-free over one sequence: row p reads token tokens[p] and hidden_TD[p]
    (the decoder layer's attention and MLP through the naive ops)."""
    eps = layer.config.rms_norm_eps
    ids = torch.tensor(tokens)
    e = rms(target.model.embed_tokens.weight[ids], layer.enorm.weight, eps)
    x = torch.cat([e, rms(hidden_TD, layer.hnorm.weight, eps)], dim=-1) @ layer.eh_proj.weight.T
    x = x + layer.attention(x, ForwardBatch.from_tokens(ids[None]), None, 0)
    return x + layer.feed_forward(rms(x, layer.post_attention_layernorm.weight, eps))


def test_the_first_drafts_equal_a_hand_written_forward_of_the_layer(folder) -> None:
    _, path, _ = folder
    target = load_model(path, mtp=True)
    layer = load_mtp(path, target)
    engine = LLMEngine(target, ByteTokenizer(target.config.vocab_size), EngineConfig(**BASE), speculative=SpeculativeConfig(2), mtp_layer=layer)
    prompt = [7, 300, 12, 5, 99, 41, 8, 250, 3, 17, 64, 2, 90, 33, 11, 6, 120, 4, 71]  # two prefill chunks of 16 and 3
    engine.add_request("r", prompt, GREEDY)
    while not engine.scheduler.requests["r"].num_output_tokens:
        engine.step()
    req = engine.scheduler.requests["r"]
    proposer = engine.proposer
    assert isinstance(proposer, MTPProposer)
    propose_drafts(proposer, SpeculativeConfig(2), engine.scheduler.running, engine.max_model_len, engine.runner.sampler.grammars, target.config.vocab_size)
    tokens = req.token_ids  # the prompt and the first sampled token
    assert len(req.draft_token_ids) == 2
    naive = OpChoice(kda="naive", conv="naive", mla="naive", mla_decode="naive", moe="naive", attn_res="naive", linear="naive", norm="naive", route="naive")
    ref = load_model(path, ops=naive, mtp=True)
    ref_layer = load_mtp(path, ref)
    with torch.no_grad():
        h = ref.hidden_states(ForwardBatch.from_tokens(torch.tensor([tokens[:-1]])))
        x1 = reference_mtp(ref_layer, ref, tokens[1:], h)
        logits1 = ref.lm_head(rms(x1[-1], ref_layer.shared_head.norm.weight, ref.config.rms_norm_eps))
        got1 = layer.compute_logits(proposer._seen["r"].last_x)
        torch.testing.assert_close(got1, logits1, atol=2e-5, rtol=1e-5)
        assert req.draft_token_ids[0] == int(logits1.argmax())
        # the second draft: one position on, reading the first draft and the layer's own output in place of h
        x2 = reference_mtp(ref_layer, ref, tokens[1:] + [req.draft_token_ids[0]], torch.cat([h, x1[-1:]]))
        logits2 = ref.lm_head(rms(x2[-1], ref_layer.shared_head.norm.weight, ref.config.rms_norm_eps))
    assert req.draft_token_ids[1] == int(logits2.argmax())
    assert float(logits2.topk(2).values[0] - logits2.topk(2).values[1]) > 1e-4  # the argmax is not a near tie


def run(target, layer, prompts, k: int = 3, **cfg) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(target, ByteTokenizer(target.config.vocab_size), EngineConfig(**{**BASE, **cfg}), speculative=SpeculativeConfig(k), mtp_layer=layer)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))], engine


PROMPTS = [list(range(40, 70)), list(range(40, 70)) + [9, 8, 7], [5, 6, 7, 8] * 5, [100, 3, 77]]


@pytest.mark.parametrize(
    "cfg",
    [{}, dict(enable_prefix_caching=True, prefix_match_unit=8), dict(num_pages=20, max_num_batched_tokens=10, max_model_len=60)],
    ids=["plain", "prefix-cache", "preemption"],
)
def test_greedy_equals_plain_decoding(folder, cfg) -> None:
    _, path, _ = folder
    target = load_model(path, mtp=True)
    layer = load_mtp(path, target)
    plain = LLMEngine(target, ByteTokenizer(target.config.vocab_size), EngineConfig(**{**BASE, **cfg}))
    want: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        plain.add_request(str(i), p, GREEDY)
    while plain.has_unfinished():
        for o in plain.step():
            want[o.request_id].extend(o.new_token_ids)
    got, engine = run(target, layer, PROMPTS, **cfg)
    assert got == [want[str(i)] for i in range(len(PROMPTS))]
    stats = engine.spec_stats
    assert stats is not None and stats.num_draft_tokens > 0
    if "max_num_batched_tokens" in cfg:
        assert engine.scheduler.num_preemptions_total > 0


def test_llm_and_speculative_config_build_it(folder) -> None:
    _, path, _ = folder
    engine, _ = server_configs(serve_args("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'))
    assert (engine.speculative_method, engine.speculative_model, engine.num_speculative_tokens) == ("mtp", None, 2)
    with pytest.raises(ValueError, match="leave out 'model'"):
        server_configs(serve_args("--speculative-config", '{"method": "mtp", "model": "tiny"}'))
    prompt = "The quick brown fox"
    with LLM(str(path), num_pages=64, page_size=4, max_num_seqs=2, max_model_len=64) as plain:
        want = plain.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with LLM(str(path), num_pages=64, page_size=4, max_num_seqs=2, max_model_len=64, speculative_method="mtp", num_speculative_tokens=2) as spec:
        got = spec.generate(prompt, GREEDY)[0].outputs[0].token_ids
        stats = spec.engine.spec_stats
    assert got == want
    assert stats is not None and stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="speculative method 'mtp' reads the multi-token-prediction layer of the model's checkpoint folder"):
        LLM("debug", speculative_method="mtp")


def test_an_aborted_request_leaves_nothing_in_the_layers_cache(folder) -> None:
    _, path, _ = folder
    target = load_model(path, mtp=True)
    layer = load_mtp(path, target)
    engine = LLMEngine(target, ByteTokenizer(target.config.vocab_size), EngineConfig(**BASE), speculative=SpeculativeConfig(2), mtp_layer=layer)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[3], GREEDY)
    for _ in range(3):
        engine.step()
    proposer = engine.proposer
    assert isinstance(proposer, MTPProposer) and proposer.cache.num_request_holders == 2
    engine.abort("a")
    engine.abort("b")  # idle now: check_integrity_when_idle runs, and the layer's cache must be empty
    assert proposer.cache.num_request_holders == 0
