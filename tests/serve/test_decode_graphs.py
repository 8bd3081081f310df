"""Decode graphs (serve/graphs.py) on CPU, through tests/serve/replay_graph.py's stand-in for CUDA graph capture: every
replay equals the eager forward on the same inputs bit for bit and the eager forward on the unpadded step to rounding,
the engine's tokens equal an eager engine's, padding rows write only to the scratch slot and page, the graph's expert
form is swapped in for its runs only, and a forward that decides on the host fails at capture."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import openk3.serve.engine as engine_module
from openk3.config import debug
from openk3.llm import LLM
from openk3.model.batch import ForwardBatch
from openk3.model.model import K3ForCausalLM, OpChoice
from openk3.model.moe import LocalExperts
from openk3.ops.registry import OpTarget
from openk3.serve.config import EngineConfig
from openk3.serve.graphs import DecodeGraphs, batch_buckets, graph_expert_form, width_buckets
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.replay_graph import CaptureError, ReplayCapture

PROMPTS = [[1 + i, 2, 3, 4 + i, 5][: 2 + i % 4] for i in range(6)]
# different lengths, so the batch shrinks step by step through the buckets (6 -> 1)
PARAMS = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(6)]


def build(monkeypatch: pytest.MonkeyPatch, graphs: bool, ops: OpChoice | None = None, **overrides: Any) -> tuple[LLM, ReplayCapture]:
    """The debug model with the ops a CUDA target resolves to (the forms a graph captures on a GPU), on CPU tensors."""
    capture = ReplayCapture()
    monkeypatch.setattr(engine_module, "CudaGraphCapture", lambda device: capture)
    model = K3ForCausalLM(debug(), ops)
    model.init_weights(seed=3)
    settings: dict[str, Any] = dict(num_pages=64, page_size=4, max_num_seqs=6, max_model_len=64, device="cpu") | overrides
    llm = LLM(model.eval(), ByteTokenizer(256), cuda_graphs=graphs, **settings)
    model.select_ops(target=OpTarget("cuda"))
    capture.checked_cache = llm.engine.cache.tensors
    return llm, capture


def graphs_of(llm: LLM) -> DecodeGraphs:
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    return graphs


def compare_with_unpadded_eager(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[int]:
    """Every replay's logits also against the model's eager forward on the step as the runner built it (no padding, its
    own width, the model's own expert form), on a copy of the cache: padding rows or stale page entries that leaked into
    real rows would show here, where the bit-for-bit check (same static batch) cannot see them."""
    cache = llm.engine.cache.tensors
    real_run = DecodeGraphs.run
    pools = cache.pools()
    compared: list[int] = []

    def run(self: DecodeGraphs, batch: ForwardBatch, bucket: tuple[int, int]) -> torch.Tensor:
        before = [p.clone() for p in pools]
        eager = self.model(batch, cache)
        for p, old in zip(pools, before, strict=True):
            p.copy_(old)
        got = real_run(self, batch, bucket)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        compared.append(batch.num_seqs)
        return got

    monkeypatch.setattr(DecodeGraphs, "run", run)
    return compared


def tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, params: Any = PARAMS) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert width_buckets(1) == [1] and width_buckets(16) == [1, 2, 4, 8, 16] and width_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_graph_expert_form() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graph_expert_form("static", True, cuda) == "static" and graph_expert_form("triton", True, cuda) == "triton"
    assert graph_expert_form("auto", True, cuda) == "triton"  # packed MXFP4 on CUDA: read packed
    assert graph_expert_form("auto", True, cpu) == "static" and graph_expert_form("sized", False, cuda) == "static"


@pytest.mark.parametrize("moe", ["auto", "static"])
def test_replays_equal_the_eager_forward_and_the_eager_engine(monkeypatch: pytest.MonkeyPatch, moe: str) -> None:
    """Every replay is checked against the eager forward on the same inputs (replay_graph.py, checked) and against the
    unpadded step. With moe="static" the eager engine runs the graphs' expert form; with "auto" its experts sum in
    another order (a rounding step apart) and the greedy tokens still agree here."""
    eager, _ = build(monkeypatch, graphs=False, ops=OpChoice(moe=moe))
    want = tokens(eager)
    graphed, capture = build(monkeypatch, graphs=True, ops=OpChoice(moe=moe))
    compared = compare_with_unpadded_eager(monkeypatch, graphed)
    assert tokens(graphed) == want
    graphs = graphs_of(graphed)
    assert sorted({rows for rows, _ in graphs._graphs}) == [1, 2, 4, 6], "the shrinking batch passed through every bucket"
    graphed.engine.check_integrity()
    assert graphed.engine.cache.scratch_page is not None
    graphs.page_table[0, 0] = graphed.engine.cache.scratch_page + 1
    with pytest.raises(AssertionError, match="static page table entries outside"):
        graphs.check_integrity()
    graphs.page_table[0, 0] = 0
    assert graphs.replays == sum(g.replays for g in capture.graphs) == len(compared) >= 10
    layers = graphs.model.moe_layers()
    assert all(isinstance(m.backend, LocalExperts) and m.backend.impl == moe for m in layers), "eager form restored"
    graphed.close()
    eager.close()


def test_fresh_sequences_on_dirty_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-token prompts are decode steps from context 0: a graphed step must mask their slots' old states, which the
    first round leaves dirty (found by review: without this case a graph that never masked fresh rows passed)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [3, 3], [2, 2, 2], [6, 1]]  # all six slots
    runs = []
    for graphs in (False, True):
        llm, _ = build(monkeypatch, graphs=graphs, ops=OpChoice(moe="static"))
        tokens(llm, first, params)
        runs.append(tokens(llm, [[9], [4], [7]], params))
        assert not graphs or graphs_of(llm).replays > 0
        llm.close()
    assert runs[0] == runs[1]


def test_prefix_cache_and_long_contexts_mix_graphs_and_eager_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix hits start sequences from restored states mid-context; contexts longer than the graphs' pages run eagerly."""
    prompt = [7, 1, 8, 2, 8] * 4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    settings: dict[str, Any] = dict(enable_prefix_caching=True, prefix_match_unit=8, long_prefill_token_threshold=16)
    eager, _ = build(monkeypatch, graphs=False, **settings)
    want = tokens(eager, [prompt, prompt[:12] + [3]], params)
    graphed, _ = build(monkeypatch, graphs=True, **settings)
    graphs = graphs_of(graphed)
    graphs.widths = [1, 2, 4, 6]  # 24 tokens: the first prompt's last decode steps outgrow the graphs and run eagerly
    assert tokens(graphed, [prompt, prompt[:12] + [3]], params) == want and graphs.replays > 0
    assert tokens(graphed, [prompt], params) == want[:1]
    stats = graphed.engine.stats().prefix_cache
    assert stats is not None and stats.hits > 0
    graphed.close()
    eager.close()


def test_padding_rows_write_only_the_scratch_slot_and_page(monkeypatch: pytest.MonkeyPatch) -> None:
    llm, _ = build(monkeypatch, graphs=True)
    cache, graphs = llm.engine.cache, graphs_of(llm)
    assert cache.scratch_slot == 6 and cache.scratch_page == 64
    g = torch.Generator().manual_seed(0)
    pools = cache.tensors.pools()
    for p in pools:
        p.copy_(torch.randn(p.shape, generator=g))
    before = [p.clone() for p in pools]
    slots, pages = [5, 1, 3], [[9, 10, 11], [2, 0, 4], [30, 31, 32]]
    batch = ForwardBatch.for_step([[11], [12], [13]], [5, 6, 7], slots, torch.tensor(pages))
    with torch.inference_mode():
        bucket = graphs.bucket_for(batch)
        assert bucket == (4, 4)
        graphs.run(batch, bucket)
    n_kda = len(cache.tensors.kda_state)
    for i, (p, old) in enumerate(zip(pools, before, strict=True)):
        changed = (p != old).flatten(1).any(1).nonzero().squeeze(1).tolist()
        if i < 2 * n_kda:  # state and conv pools: the batch's slots and the scratch slot
            assert set(changed) <= {*slots, cache.scratch_slot}
        else:  # latent pages: the page of each new token (position // 4) and the scratch page
            assert set(changed) <= {10, 0, 31, cache.scratch_page}
    assert graphs.page_table[:3, 3:4].eq(cache.scratch_page).all(), "past a row's pages: the scratch page, not stale ids"
    llm.close()


def test_steps_that_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    llm, _ = build(monkeypatch, graphs=True, cuda_graph_max_batch=4)
    graphs = graphs_of(llm)
    assert graphs.buckets == [1, 2, 4] and graphs.widths == [1, 2, 4, 8, 16]
    table = torch.zeros(5, 3, dtype=torch.int64)
    assert graphs.bucket_for(ForwardBatch.for_step([[1]] * 5, [1] * 5, list(range(5)), table)) is None  # wider than 4
    assert graphs.bucket_for(ForwardBatch.for_step([[1, 2], [3]], [0, 4], [0, 1], table[:2])) is None  # not decode
    assert graphs.bucket_for(ForwardBatch.for_step([[1]] * 3, [1] * 3, [0, 1, 2], torch.zeros(3, 17, dtype=torch.int64))) is None
    assert graphs.bucket_for(ForwardBatch.for_step([[1]] * 3, [1] * 3, [0, 1, 2], table[:3])) == (4, 4)
    llm.close()


def test_a_forward_that_decides_on_the_host_fails_at_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `capturable` the KDA layers ask the batch whether any sequence is fresh and whether its slots are
    consecutive: host reads, which a capture refuses (on CUDA: an error, or a graph that replays the capture's answer).
    The warm-up run's answers do not help: every run gets a new batch object (serve/graphs.py)."""
    real = ForwardBatch.__init__

    def not_capturable(self: ForwardBatch, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **(kwargs | {"capturable": False}))

    llm, _ = build(monkeypatch, graphs=True)
    monkeypatch.setattr(ForwardBatch, "__init__", not_capturable)
    with pytest.raises(RuntimeError, match="decode graph capture failed for batch 1 x 1 pages .*CaptureError") as failed:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
    assert isinstance(failed.value.__cause__, CaptureError)
    llm.close()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_batch=4 sizes the decode graphs: it needs cuda_graphs=True"):
        EngineConfig(cuda_graph_max_batch=4)
    with pytest.raises(ValueError, match="at most max_num_seqs=8"):
        EngineConfig(cuda_graphs=True, cuda_graph_max_batch=9, max_num_seqs=8)
    model = K3ForCausalLM(debug())
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device, not cpu"):
        LLM(model.eval(), ByteTokenizer(256), num_pages=16, page_size=4, max_model_len=32, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.CUDAGraph)")
def test_cuda_graphs_give_the_eager_tokens_on_a_gpu() -> None:
    """The real capture, with the graphs' expert form for the eager engine too, so the same tokens."""

    def run(graphs: bool) -> tuple[list[list[int]], int]:
        model = K3ForCausalLM(debug(), OpChoice(moe="static"))
        model.init_weights(seed=3)
        llm = LLM(model.eval().cuda(), ByteTokenizer(256), num_pages=64, page_size=4, max_num_seqs=6, max_model_len=64, cuda_graphs=graphs)
        got = tokens(llm)
        replays = llm.engine.runner.graphs.replays if llm.engine.runner.graphs is not None else 0
        llm.close()
        return got, replays

    want, _ = run(False)
    got, replays = run(True)
    assert got == want and replays >= 10
