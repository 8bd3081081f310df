"""The MoE token exchange (issue 37 round seven): all-to-all, or TensorRT-LLM's all-gather / reduce-scatter under
attention DP when its all-to-all is off, which moves every rank's tokens to every rank and hides under nothing."""

from __future__ import annotations

import math

import pytest

from openk3.planner import CommParams, Layout, Quantisation, Scenario, Workload, load_catalogue
from openk3.planner.comm import (
    Exchange,
    a2a_layer_time,
    allgather_layer_time,
    combine_bytes_per_copy,
    copies_per_token,
    dispatch_bytes_per_copy,
    moe_chunks,
    remote_domains_per_token,
)
from openk3.planner.models import deepseek_v3
from openk3.planner.perf import decode_step
from openk3.planner.traffic import a2a_bytes

FP8 = Quantisation.named("fp8")
B200 = load_catalogue().system("hgx-b200")


def test_allgather_moves_every_other_ranks_tokens_whatever_the_routing() -> None:
    cfg, comm, tokens = deepseek_v3(), CommParams(), 640.0
    t = allgather_layer_time(cfg, FP8, 4, B200, comm, tokens)
    bw = B200.accelerator.scale_up_bw * comm.scale_up_efficiency
    rows = 3 * tokens  # the three other ranks' tokens, into this rank and (reduce-scatter) out of it
    assert t.dispatch_s == pytest.approx(comm.dispatch_floor_s + rows * dispatch_bytes_per_copy(cfg, FP8) / bw)
    assert t.combine_s == pytest.approx(comm.combine_floor_s + rows * combine_bytes_per_copy(cfg, FP8) / bw)
    assert t.scale_out_fraction == 0.0
    # at EP4 with top-8 a token reaches ~3.9 ranks, so the all-to-all moves less than the whole batch
    assert a2a_layer_time(cfg, FP8, 4, B200, comm, tokens).total_s < t.total_s
    assert allgather_layer_time(cfg, FP8, 1, B200, comm, tokens).total_s == 0.0


def test_an_allgather_exchange_is_never_hidden_under_compute() -> None:
    sc = Scenario(deepseek_v3(), FP8, Layout(4, tp=1), Workload(context=2000, concurrency=4 * 640), B200)
    a2a = decode_step(sc)
    gathered = decode_step(sc.with_(comm=CommParams(exchange=Exchange.ALLGATHER)))
    assert a2a.exposed_comm_s < a2a.comm_s  # the default two-batch overlap hides part of the all-to-all
    assert gathered.exposed_comm_s == pytest.approx(gathered.comm_s) and gathered.comm_s > a2a.comm_s
    assert gathered.local_s == pytest.approx(a2a.local_s)  # the kernels are the same; only the exchange moved


def test_exchange_is_checked() -> None:
    with pytest.raises(ValueError, match="exchange"):
        CommParams(exchange="allgather")  # type: ignore[arg-type]


def test_moe_chunks_read_the_experts_again_and_pay_the_floors_per_chunk() -> None:
    """`CommParams.moe_chunk_tokens` (off by default; benchmarks/planner_moe_chunks.py): TensorRT-LLM's CUTLASS MoE runs
    the gathered tokens in ceil(tokens / chunk) chunks, each through the experts and its own collectives."""
    gather = CommParams(exchange=Exchange.ALLGATHER)
    chunked = CommParams(exchange=Exchange.ALLGATHER, moe_chunk_tokens=1536)
    assert [moe_chunks(chunked, t) for t in (1.0, 1536.0, 1537.0, 8 * 384.0)] == [1, 1, 2, 2]
    assert moe_chunks(gather, 1e6) == 1 and moe_chunks(CommParams(), 1e6) == 1
    cfg, tokens = deepseek_v3(), 384.0
    one, two = allgather_layer_time(cfg, FP8, 8, B200, gather, tokens), allgather_layer_time(cfg, FP8, 8, B200, chunked, tokens)
    assert two.dispatch_s - one.dispatch_s == pytest.approx(gather.dispatch_floor_s)  # the bytes are the same, split
    assert two.combine_s - one.combine_s == pytest.approx(gather.combine_floor_s)
    sc = Scenario(cfg, FP8, Layout(8, tp=1), Workload(context=2000, concurrency=8 * 384), B200, comm=gather)
    e1 = {c.name: c for c in decode_step(sc).components}["experts"]
    e2 = {c.name: c for c in decode_step(sc.with_(comm=chunked)).components}["experts"]
    assert e2.bytes == pytest.approx(2 * e1.bytes) and e2.flops == pytest.approx(e1.flops)  # weights twice, work once
    with pytest.raises(ValueError, match="moe_chunk_tokens"):
        CommParams(moe_chunk_tokens=1536)  # the all-to-all does not chunk this way
    with pytest.raises(ValueError, match="moe_chunk_tokens"):
        CommParams(exchange=Exchange.ALLGATHER, moe_chunk_tokens=0)


H100 = load_catalogue().system("hgx-h100")


def test_domain_forwarding_crosses_the_nic_once_per_remote_node() -> None:
    """DeepEP's normal kernels (issue 37 round eight): over the NIC a token goes once to each remote node holding one of
    its experts, and NVLink carries it on to the ranks there; per-rank copies each cross the NIC."""
    cfg, tokens = deepseek_v3(), 2000.0
    per_rank, forwarded = CommParams(), CommParams(forward_by_domain=True)
    nodes = remote_domains_per_token(cfg, 32, 8)
    # uniform top-8 over 256 experts, 64 per node: P(a node is missed) = C(192, 8) / C(256, 8) ~ 0.097
    assert nodes == pytest.approx(3 * (1 - math.comb(192, 8) / math.comb(256, 8)))
    assert remote_domains_per_token(cfg, 8, 8) == 0.0  # one node: nothing crosses the NIC
    t = a2a_layer_time(cfg, FP8, 32, H100, forwarded, tokens)
    out_bw = H100.scale_out_bw * forwarded.scale_out_efficiency
    nic_s = tokens * nodes * dispatch_bytes_per_copy(cfg, FP8) / out_bw
    assert t.dispatch_s == pytest.approx(forwarded.dispatch_floor_s + nic_s)  # NIC-bound: NVLink is 9x wider
    assert t.total_s < 0.6 * a2a_layer_time(cfg, FP8, 32, H100, per_rank, tokens).total_s
    # inside one scale-up domain forwarding changes nothing
    assert a2a_layer_time(cfg, FP8, 8, H100, forwarded, tokens) == a2a_layer_time(cfg, FP8, 8, H100, per_rank, tokens)
    with pytest.raises(ValueError, match="forward_by_domain"):
        CommParams(dedup=False, forward_by_domain=True)


def test_flow_bytes_follow_domain_forwarding() -> None:
    """The bytes-by-flow report (traffic.py) counts what the forwarding model times: NIC bytes per remote node."""
    sc = Scenario(deepseek_v3(), FP8, Layout(32, tp=1), Workload(context=2000, concurrency=32 * 64), H100)
    up, out = a2a_bytes(sc, 64.0, 1.0)
    fwd_up, fwd_out = a2a_bytes(sc.with_(comm=CommParams(forward_by_domain=True)), 64.0, 1.0)
    assert up + out == pytest.approx(fwd_up)  # every rank copy still crosses NVLink somewhere
    assert fwd_out / out == pytest.approx(remote_domains_per_token(deepseek_v3(), 32, 8) / (copies_per_token(deepseek_v3(), 32, True)[0] * 24 / 31))


def test_flow_bytes_follow_the_allgather_exchange() -> None:
    """`traffic.a2a_bytes` with `Exchange.ALLGATHER` (issue 37 round ten; it counted the all-to-all's copies until then):
    the other ranks' tokens in and this rank's out to each, in the gather and the reduce-scatter, whatever the routing."""
    cfg, tokens = deepseek_v3(), 384.0
    sc = Scenario(cfg, FP8, Layout(8, tp=1), Workload(context=2000, concurrency=8 * 384), B200, comm=CommParams(exchange=Exchange.ALLGATHER))
    per_copy = dispatch_bytes_per_copy(cfg, FP8) + combine_bytes_per_copy(cfg, FP8)
    assert a2a_bytes(sc, tokens, 1.3) == (pytest.approx(2 * 7 * tokens * per_copy), 0.0)  # one node: all NVLink, no imbalance term
    up, out = a2a_bytes(sc.with_(layout=Layout(16, tp=1), system=H100), tokens, 1.0)
    assert out == pytest.approx(2 * 15 * tokens * per_copy * 8 / 15) and up == pytest.approx(2 * 15 * tokens * per_copy * 7 / 15)
    assert a2a_bytes(sc, tokens, 1.0)[0] > a2a_bytes(sc.with_(comm=CommParams()), tokens, 1.0)[0]  # the whole batch, not its copies
