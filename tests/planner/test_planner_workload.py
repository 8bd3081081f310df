"""Mixed quantisation (NVFP4 / MXFP4 / FP8 experts, FP8 trunk and KV, KDA state dtype) and workloads -> fleets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from openk3.config import k3
from openk3.planner.cli import main
from openk3.planner.dtypes import with_dtypes
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Layout, Quantisation, Workload
from openk3.planner.memory import cache_spec, expert_bytes, weight_bytes
from openk3.planner.perf import Scenario, decode_step, evaluate, prefill_step
from openk3.planner.workload import RequestMix, demand
from tests.planner import hf_configs as hf


def test_block_formats_cost_their_scales() -> None:
    c, base = k3(), Quantisation()
    per_expert = c.routed_expert_params()
    nv = with_dtypes(base, expert="nvfp4")
    assert expert_bytes(c, nv) == per_expert * (4 + 8 / 16) / 8 + 3 * 4  # E2M1 + FP8 per 16, + fp32 per tensor
    assert expert_bytes(c, with_dtypes(base, expert="mxfp4")) == per_expert * (4 + 8 / 32) / 8
    assert nv.expert_compute == "fp4" and with_dtypes(base, expert="mxfp4").expert_compute == "fp8"
    w_nv, w_mx = weight_bytes(c, nv), weight_bytes(c, base)
    assert w_nv.routed_bytes / w_mx.routed_bytes == pytest.approx(4.5 / 4.25, rel=1e-6)
    assert with_dtypes(base, trunk="fp8").trunk_bits == 8 and weight_bytes(c, with_dtypes(base, trunk="fp8")).trunk_bytes == w_mx.trunk_bytes / 2


def test_kv_and_state_dtypes() -> None:
    c, base = k3(), Quantisation()
    spec, fp8 = cache_spec(c, base), cache_spec(c, with_dtypes(base, kv="fp8"))
    assert spec.mla.bytes_per_token == 27648  # 24 MLA layers x 576 x bf16
    assert fp8.mla.bytes_per_token == 24 * (576 + 9 * 4)  # the engine's FP8 rows: e4m3 values + an fp32 scale per 64
    assert fp8.kda.conv_bytes == spec.kda.conv_bytes  # the conv windows stay bf16 under an fp8 latent cache
    bf16_state = cache_spec(c, with_dtypes(base, state="bf16"))
    assert bf16_state.kda.recurrent_bytes * 2 == spec.kda.recurrent_bytes and bf16_state.kda.conv_bytes == spec.kda.conv_bytes
    with pytest.raises(ValueError, match="--expert-dtype='int3'"):
        with_dtypes(base, expert="int3")


def test_request_mix_shapes() -> None:
    mix = RequestMix(((1000, 100), (3000, 300)))
    assert mix.mean_input == 2000 and mix.mean_output == 200
    # output-weighted: 100 steps at 1000 + 49.5, 300 at 3000 + 149.5
    assert mix.decode_context == math.ceil((100 * 1049.5 + 300 * 3149.5) / 400)
    assert mix.ttft_prompt == 3000
    with pytest.raises(ValueError, match="rate"):
        RequestMix(((1, 1),), rate=0.0)
    with pytest.raises(ValueError, match="output tokens"):
        RequestMix(((10, 0),))


def _scenario(mix: RequestMix) -> Scenario:
    system = load_catalogue().system("gb300-nvl72")
    wl = Workload(context=mix.decode_context, concurrency=512, prompt=mix.ttft_prompt)
    return Scenario(k3(), Quantisation(), Layout(16, tp=2), wl, system)


def test_demand_from_first_principles() -> None:
    mix = RequestMix(((8192, 1024),), rate=40.0)
    sc = _scenario(mix)
    m = evaluate(sc)
    d = demand(sc, m, mix)
    busy = 8192 / m.prefill_tok_s + 1024 / m.throughput_tok_s
    assert d.busy_s_per_request == pytest.approx(busy)
    assert d.replicas == math.ceil(40 * busy) and d.accelerators == 16 * d.replicas
    assert d.utilisation == pytest.approx(40 * busy / d.replicas)
    usd_s = sc.system.price_per_hour * 16 / 3600
    assert d.usd_per_request == pytest.approx(usd_s * busy) and d.usd_per_request_fleet == pytest.approx(usd_s * d.replicas / 40)
    assert d.usd_per_m_tokens == pytest.approx(usd_s * busy / (8192 + 1024) * 1e6)
    assert d.prefill_s.max == pytest.approx(m.ttft_s)  # one prompt: its TTFT
    stretch = 1 / (1 - 40 / d.replicas * 8192 / m.prefill_tok_s)
    assert d.decode_s.p50 == pytest.approx(1024 * decode_step(sc).total_s * stretch)


def test_demand_per_request_times_follow_the_distribution() -> None:
    mix = RequestMix(((2048, 64), (2048, 64), (32768, 2048)))
    sc = _scenario(mix)
    d = demand(sc, evaluate(sc), mix)
    long_ttft = 4 * prefill_step(sc.with_(workload=Workload(context=mix.decode_context, concurrency=512, prompt=32768))).total_s
    assert d.prefill_s.max == pytest.approx(long_ttft) and d.prefill_s.p50 < d.prefill_s.max / 10
    assert d.decode_s.max / d.decode_s.p50 == pytest.approx(2048 / 64)
    assert d.replicas is None and d.utilisation == 1.0


def test_cli_workload_sizes_the_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = tmp_path / "requests.json"
    reqs.write_text(json.dumps([[4096, 512], [1024, 256], [8192, 1024]]))
    model = hf.write(tmp_path, hf.qwen3_moe())
    args = ["plan", "--model", str(model), "--hardware", "hgx-h200", "--requests", str(reqs), "--rate", "25", "--max-accelerators", "16"]
    assert main([*args, "--expert-dtype", "fp8", "--kv-dtype", "fp8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    d = doc["workload"]["demand"]
    assert d["accelerators"] == d["replicas"] * doc["layout"]["accelerators"] and d["replicas"] >= math.ceil(25 * d["busy_s_per_request"])
    assert doc["inputs"]["quantisation"]["cache_dtype_bytes"] == 1 and doc["inputs"]["quantisation"]["expert_format"] == "fp8"
    assert doc["context"] == RequestMix(((4096, 512), (1024, 256), (8192, 1024))).decode_context
    assert main([*args]) == 0
    out = capsys.readouterr().out
    assert "requests/s ->" in out and "per request" in out and "p90" in out


def test_cli_workload_inputs_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--input", "2k", "--max-accelerators", "8"]) == 2
    assert main(["plan", "--rate", "3", "--max-accelerators", "8"]) == 2
    assert main(["plan", "--input", "2k", "--output", "1k", "--context", "8k", "--max-accelerators", "8"]) == 2
    err = capsys.readouterr().err
    assert "--input and --output go together" in err and "--rate needs a workload" in err and "drop --context" in err
