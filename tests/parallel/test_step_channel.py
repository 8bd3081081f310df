"""The driver -> worker step channel carries every ForwardBatch field exactly, and rank 0's EP stats reach /metrics."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

from openk3.api.metrics import ServerMetrics
from openk3.config import debug
from openk3.llm import LLM
from openk3.model.batch import CacheTensors, ForwardBatch, HostFacts, StateCut
from openk3.parallel.ep.stats import EPStats
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks
from openk3.parallel.serving.driver import EPTotals
from openk3.parallel.serving.step_channel import CacheShape, CopyLog, StepChannel


def batches() -> list[ForwardBatch]:
    table = torch.tensor([[3, 4, 0], [7, 8, 9]])
    cached = ForwardBatch.for_step([[11, 12, 13], [14]], [16, 40], [2, 5], table)
    decode = ForwardBatch.for_step([[1], [2]], [5, 6], [0, 1], table[:, :1])
    fresh = ForwardBatch.for_step([[5, 6], [7]], [0, 3], [4, 5], table[:, :2])  # a new sequence, consecutive slots
    cuts = dataclasses.replace(cached, state_cuts=(StateCut(0, 2, 1), StateCut(0, 1, 0)))  # prefix-cache snapshots inside a step
    return [cached, decode, ForwardBatch.from_tokens(torch.arange(6).view(2, 3)), fresh, cuts]  # the third: no cache, every row's logits


def fields(b: ForwardBatch) -> dict:
    """Every field of the batch (whatever ForwardBatch holds, so a field the channel drops fails the comparison)."""
    out = {}
    for f in dataclasses.fields(b):
        v = getattr(b, f.name)
        out[f.name] = v.tolist() if isinstance(v, torch.Tensor) else v
    return out


def exchange(ctx: ParallelContext) -> list:
    channel = StepChannel(ctx)
    cache = CacheTensors.allocate(debug(), num_slots=3, num_pages=5, page_size=4, dtype=torch.bfloat16)
    if ctx.rank == 0:
        channel.send_cache(cache)
        channel.send_copies([(1, 0, 2), (2, 4, 1)])
        for b in batches():
            channel.send_step(b)
        channel.send_stop()
        return [tuple(CacheShape.of(cache)), [(1, 0, 2), (2, 4, 1)]] + [fields(b) for b in batches()] + [None]
    with pytest.raises(RuntimeError, match="only rank 0"):
        channel.send_stop()
    got: list = []
    while True:
        message = channel.receive("cpu")
        if isinstance(message, CacheShape):
            pools = message.allocate(debug(), "cpu")
            assert [t.shape for t in pools.mla_latent] == [t.shape for t in cache.mla_latent]
            assert pools.conv_state[0].dtype == torch.bfloat16
            got.append(tuple(message))
        elif isinstance(message, CopyLog):
            got.append(message.copies)
        else:
            got.append(None if message is None else fields(message))
        if message is None:
            return got


@pytest.mark.distributed
def test_step_channel_round_trip() -> None:
    sent, received = run_ranks(exchange, 2)
    assert received == sent and len(sent) == 8
    assert sent[6]["state_cuts"] == (StateCut(0, 2, 1), StateCut(0, 1, 0)) and sent[2]["state_cuts"] == ()
    assert sent[3]["is_decode"] and not sent[2]["is_decode"] and sent[4]["page_table"] is None
    # the host facts travel in the header: none given, slots not consecutive, consecutive, and a fresh sequence
    assert [sent[i]["host_facts"] for i in (4, 2, 3, 5)] == [None, HostFacts(False, None), HostFacts(False, (0, 2)), HostFacts(True, (4, 6))]


def test_step_channel_refuses_half_a_cache_addressing() -> None:
    cached = batches()[0]
    no_slots = dataclasses.replace(cached, state_slots=None)
    with pytest.raises(ValueError, match="has page_table but state_slots is None"):
        StepChannel.encode_step(no_slots)
    with pytest.raises(ValueError, match="has state_slots but page_table is None"):
        StepChannel.encode_step(dataclasses.replace(cached, page_table=None))
    header, payload = StepChannel.encode_step(cached)
    assert cached.page_table is not None
    assert header[3] == cached.page_table.shape[1]
    assert payload.numel() == 4 + 4 + 3 + 2 + 2 + 6 + 2  # ids, positions, cu_seqlens, context, slots, table, logits rows
    with pytest.raises(ValueError, match="graphs capture a single-process step only"):
        StepChannel.encode_step(dataclasses.replace(cached, capturable=True))


def test_ep_stats_in_metrics() -> None:
    def stats(layer: int, entries: tuple[int, ...], sent: int) -> EPStats:
        return EPStats(layer, "moonep", entries, entries, max(entries) / (sum(entries) / 2), 0.25, sent, 100, 1, 0.0, 0.0)

    totals = EPTotals()
    totals.add([stats(1, (6, 2), 1000), stats(3, (4, 4), 500)])
    totals.add([stats(1, (3, 5), 10), stats(3, (4, 4), 20)])
    metrics = ServerMetrics("m")
    metrics.attach_ep(totals)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("debug")
    metrics.observe_engine(llm.engine)
    metrics.observe_engine(llm.engine)  # a second snapshot with nothing new adds nothing
    text = metrics.render().decode()

    def value(pattern: str) -> float:
        m = re.search(pattern + r" ([0-9.e+]+)", text)
        assert m, pattern
        return float(m.group(1))

    assert value(r'openk3:ep_recv_tokens_max\{layer="1",model_name="m"\}') == 5.0
    assert value(r'openk3:ep_recv_tokens_mean\{layer="1",model_name="m"\}') == 4.0
    assert value(r'openk3:ep_recv_tokens_total\{model_name="m",rank="0"\}') == 6 + 4 + 3 + 4
    assert value(r'openk3:ep_bytes_sent_total\{model_name="m"\}') == 1530
    assert value(r'openk3:ep_prefetch_bytes_total\{model_name="m"\}') == 400
    assert value(r'openk3:ep_spilled_entries_total\{model_name="m"\}') == 4
    assert totals.steps == 2
