"""EPLB from measured load, end to end: an engine exports the routing it served (`export_eplb_stats`, every routed entry
counted), and `ep_method="eplb", eplb_stats=FILE` places the replicas of the measured heaviest experts from that file,
giving the single process's tokens; what cannot work is refused at start-up, naming the problem."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from openk3.config import ModelConfig, debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.parallel.config import ParallelConfig
from openk3.parallel.ep.load_stats import ExpertLoad, LoadStatsError, RecordingExperts
from openk3.parallel.ep.placement import LoadCollector, eplb_placement, redundant_for
from openk3.parallel.ep.static_backend import ExpertParallelBackend
from openk3.parallel.serving.rank_model import EPLB_REDUNDANT_FRACTION, engine_placements
from openk3.serve.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 1, 1, 7], list(range(30, 70))]
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def moe_layers(config: ModelConfig) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def skewed_load_file(path: Path, config: ModelConfig | None = None, num_experts: int | None = None) -> Path:
    """A load file for `config`'s MoE layers (default: the debug model): a small uniform load, and per layer two hot
    experts away from 0 and 1, so an EPLB placement from it replicates other experts than one from a uniform load."""
    config = config or debug()
    experts = num_experts or config.moe.num_experts
    layers = {}
    for n, layer in enumerate(moe_layers(config)):
        counts = torch.full((experts,), 10, dtype=torch.int64)
        counts[(experts - 1 - n) % experts] = 500
        counts[(experts // 2 + n) % experts] = 200
        layers[layer] = counts
    ExpertLoad(experts, 16, layers).save(path)
    return path


def quiet_llm(model: str = "debug", **overrides: Any) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        return LLM(model, max_num_batched_tokens=16, **overrides)


def generate(llm: LLM) -> list[list[int]]:
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


def routed_entries(config: ModelConfig) -> int:
    """Routing entries of PROMPTS x GREEDY: every prompt token and every generated token but the last is forwarded once."""
    return sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS) * config.moe.num_experts_per_token


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """One process's greedy tokens, and the load file it exported while generating them."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("eplb") / "load.json"
    llm = quiet_llm(export_eplb_stats=str(path))
    tokens = generate(llm)
    assert isinstance(llm.model, K3ForCausalLM)
    assert not any(isinstance(moe.backend, RecordingExperts) for moe in llm.model.moe_layers()), "close() detaches the counting"
    return path, tokens


def test_one_process_exports_every_routed_entry(exported: tuple[Path, list[list[int]]]) -> None:
    path, _ = exported
    config = debug()
    load = ExpertLoad.load(path)
    load.check_model(moe_layers(config), config.moe.num_experts, source=str(path))
    assert sorted(load.layers) == moe_layers(config)
    assert all(int(counts.sum()) == routed_entries(config) for counts in load.layers.values())
    assert load.window_steps >= 1 + MAX_TOKENS - 1  # at least one prefill step and the decode steps


def test_eplb_placement_replicates_the_measured_heaviest_experts(exported: tuple[Path, list[list[int]]]) -> None:
    path, _ = exported
    config = debug()
    layers, num_experts = moe_layers(config), config.moe.num_experts
    load = ExpertLoad.load(path)
    placements = engine_placements(layers, num_experts, 2, "eplb", path)
    redundant = redundant_for(num_experts, 2, EPLB_REDUNDANT_FRACTION)
    uniform = eplb_placement(torch.ones(num_experts), 2, redundant).phys_to_log
    differs = False
    for layer in layers:
        assert torch.equal(placements[layer].phys_to_log, eplb_placement(load.layers[layer], 2, redundant).phys_to_log), layer
        replicated = placements[layer].replica_counts() > 1
        assert int(replicated.sum()) == redundant
        assert int(load.layers[layer][replicated].min()) >= int(load.layers[layer][~replicated].max()), layer
        differs |= not torch.equal(placements[layer].phys_to_log, uniform)
    assert differs, "the measured load should place differently from a uniform one (experts 0..n-1 replicated)"


@pytest.mark.distributed
def test_llm_eplb_from_the_exported_file_gives_the_single_process_tokens(exported: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    path, want = exported
    torch.set_num_threads(1)
    again = tmp_path / "again.json"
    llm = quiet_llm(ep=2, ep_method="eplb", eplb_stats=str(path), export_eplb_stats=str(again))
    assert llm._ep is not None and llm._ep.backend is not None
    inner = llm._ep.backend.inner  # rank 0's expert-parallel backend, behind its TokenSplit
    assert isinstance(inner, ExpertParallelBackend)
    layers = moe_layers(debug())
    placed = engine_placements(layers, debug().moe.num_experts, 2, "eplb", path)
    assert all(torch.equal(inner.placements[i].phys_to_log, placed[i].phys_to_log) for i in layers), "rank 0 placed from the file"
    assert generate(llm) == want
    # rank 0's TokenSplit sees the whole batch: exported under ep=2, every routed entry is counted once
    assert all(int(c.sum()) == routed_entries(debug()) for c in ExpertLoad.load(again).layers.values())


@pytest.mark.distributed
def test_a_file_for_another_model_fails_the_start_up_naming_it(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = skewed_load_file(tmp_path / "other.json", num_experts=16)
    with pytest.raises(LoadStatsError, match=f"expert load file {path}: num_experts=16, the model has 8"):
        quiet_llm(ep=2, ep_method="eplb", eplb_stats=str(path))


def test_a_file_for_another_model_is_refused(tmp_path: Path) -> None:
    config = debug()
    path = skewed_load_file(tmp_path / "other.json", num_experts=16)
    with pytest.raises(LoadStatsError, match=f"expert load file {path}: num_experts=16, the model has 8"):
        engine_placements(moe_layers(config), config.moe.num_experts, 2, "eplb", path)
    with pytest.raises(LoadStatsError, match=f"expert load file {path}: no counts for MoE layers"):
        engine_placements([*moe_layers(config), 9], 16, 2, "eplb", path)


def test_eplb_without_a_file_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="ep=2, ep_method='eplb' without eplb_stats: .*--eplb-stats FILE"):
        ParallelConfig(ep=2, ep_method="eplb")
    with pytest.raises(ValueError, match="without eplb_stats"):
        LLM("debug", ep=2, ep_method="eplb")
    with pytest.raises(ValueError, match="needs a stats file"):
        engine_placements(moe_layers(debug()), 8, 2, "eplb", None)
    ParallelConfig(ep_method="eplb")  # one rank: nothing to place


@pytest.mark.parametrize(("ep", "method"), [(2, "ep"), (2, "moonep"), (1, "eplb"), (1, "moonep")])
def test_a_file_with_another_method_is_refused(ep: int, method: str) -> None:
    with pytest.raises(ValueError, match=f"eplb_stats='load.json' with ep={ep}, ep_method='{method}': .*read only with ep > 1 and ep_method='eplb'"):
        ParallelConfig(ep=ep, ep_method=method, eplb_stats="load.json")
    if ep > 1:
        with pytest.raises(ValueError, match="a load file places eplb's replicas only"):
            engine_placements(moe_layers(debug()), 8, ep, method, "load.json")


def test_export_is_refused_with_data_parallel_attention(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="export_eplb_stats='x.json' with dp=2: .*gathering their counts over the DP ranks is not built"):
        ParallelConfig(dp=2, ep=2, export_eplb_stats="x.json")
    with pytest.raises(LoadStatsError, match="the folder .* does not exist"):
        quiet_llm(export_eplb_stats=str(tmp_path / "missing" / "load.json"))


def test_openk3_serve_refuses_before_any_rank_joins(capsys: pytest.CaptureFixture[str]) -> None:
    from openk3.cli import build_parser
    from openk3.launch.cli import run

    for flags, message in (
        (["--ep", "2", "--ep-method", "eplb"], "without eplb_stats"),
        (["--ep", "2", "--ep-method", "moonep", "--eplb-stats", "load.json"], "read only with ep > 1 and ep_method='eplb'"),
        (["--dp", "2", "--ep", "2", "--export-eplb-stats", "load.json"], "over the DP ranks is not built"),
    ):
        assert run(build_parser().parse_args(["serve", "--model", "debug", *flags])) == 2
        assert message in capsys.readouterr().err


def test_the_server_exports_after_it_drained(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from openk3.cli import build_parser
    from openk3.launch.server import build_server, export_expert_load

    torch.set_num_threads(1)
    path = tmp_path / "served.json"
    args = build_parser().parse_args(["serve", "--model", "debug", "--max-model-len", "64", "--export-eplb-stats", str(path)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        app = build_server(args)
    with TestClient(app) as client:
        body = {"model": "debug", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert not path.exists(), "written at shutdown, not before"
    assert export_expert_load(app, 0) == 0
    load = ExpertLoad.load(path)
    k = debug().moe.num_experts_per_token
    assert all(int(c.sum()) == (len(PROMPTS[0]) + 2) * k for c in load.layers.values())


def serve_one_completion(flags: list[str], tmp_path: Path) -> tuple[str, str]:
    """`torchrun ... openk3 serve --model tiny --ep 2 <flags>`: one greedy completion, then SIGTERM to rank 0; the text and the log."""
    import httpx

    from tests.parallel.test_serve_ep import PROMPT, rank0_pid, stop, torchrun_server

    with torchrun_server(["--ep", "2", *flags], tmp_path) as (proc, url, log):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
        assert reply.status_code == 200, reply.text
        stop(proc, rank0_pid(log))
    assert proc.returncode == 0, log.read_text()[-3000:]
    return reply.json()["choices"][0]["text"], log.read_text()


@pytest.mark.slow  # two torchrun servers, about 25 s
@pytest.mark.distributed
def test_the_two_run_recipe_under_torchrun(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    exported_text, log = serve_one_completion(["--export-eplb-stats", str(path)], tmp_path)
    assert f"to {path} (--eplb-stats reads it)" in log, log[-3000:]
    load = ExpertLoad.load(path)
    assert load.window_steps >= 8 and all(int(c.sum()) > 0 for c in load.layers.values())
    placed_text, _ = serve_one_completion(["--ep-method", "eplb", "--eplb-stats", str(path)], tmp_path)
    assert placed_text == exported_text


def test_cumulative_collector_sums_every_step_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    collector = LoadCollector(8, window=None)
    seen: dict[int, list[torch.Tensor]] = {1: [], 3: []}
    for step in range(50):
        for layer in (1, 3) if step % 5 else (1,):  # layer 3 skips every fifth step
            idx = torch.randint(0, 8, (int(torch.randint(1, 20, (), generator=g)), 2), generator=g)
            collector.observe(layer, idx)
            seen[layer].append(idx.reshape(-1))
    assert collector.layers() == [1, 3]
    for layer, parts in seen.items():
        assert torch.equal(collector.load(layer), torch.bincount(torch.cat(parts), minlength=8))
        assert collector.steps(layer) == len(parts)
    assert collector.steps(1) == 50 and collector.steps(3) == 40
    assert torch.equal(collector.load(7), torch.zeros(8, dtype=torch.int64))
    load = ExpertLoad.from_collector(collector)
    assert load.window_steps == 50 and int(load.layers[1].sum()) == sum(p.numel() for p in seen[1])
    with pytest.raises(ValueError, match="window=0, expected >= 1 steps"):
        LoadCollector(8, window=0)
