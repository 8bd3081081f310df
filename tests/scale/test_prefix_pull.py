"""The replicas' half of the cross-replica prefix pull (scale/prefix_pull.py), without Ray: two in-process engines, the
holder's `export` reached through a fake export call. One transfer per prefix per replica however many requests wait for
it (hinted or not); no pull when the puller holds the prefix or the hint is not a unit deeper; a holder that is pulling the prefix itself
answers after its pull; a holder that evicted it, is lost, or answers another model's record costs a counted failure and
the request computes its prompt with the same tokens."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.scale.calls import PullHint, ReplicaCall
from openk3.scale.prefix_pull import PrefixPuller, PullConfig, export
from openk3.serve.cache.hashing import chain_keys
from openk3.serve.engine import LLMEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.test_prefix_pull import ENGINE, HOLDER, PAGE, PULLER, SYSTEM, ids

GEN = SamplingParams(temperature=0, max_tokens=8)
CONFIG = PullConfig(match_unit=PAGE)


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=5)
    return m.eval()


def engine(model: K3ForCausalLM) -> LLM:
    return LLM(model, ByteTokenizer(256), **{**ENGINE, "enable_prefix_caching": True, "num_snapshot_slots": 6})


def on(llm: LLM) -> Callable[[Callable[[LLMEngine], Any]], Any]:
    """An AsyncEngine.call stand-in: runs fn on the engine now (these tests step the engines themselves)."""

    async def call(fn: Callable[[LLMEngine], Any]) -> Any:
        return fn(llm.engine)

    return call


class Holder:
    """The holder replica's `export`, counting calls; `gate` (when set) holds each answer back until the test opens it."""

    def __init__(self, llm: LLM | None, gate: asyncio.Event | None = None, fail: BaseException | None = None) -> None:
        self.llm, self.gate, self.fail, self.calls = llm, gate, fail, 0

    async def __call__(self, call: ReplicaCall) -> bytes | None:
        self.calls += 1
        assert call.target == "a" and call.pull is not None
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        assert self.llm is not None
        return await export(on(self.llm), call, CONFIG)


def request(prompt: list[int], units: int = 3, holder: str = "a") -> ReplicaCall:
    keys = tuple(chain_keys(b"router", prompt, PAGE))
    return ReplicaCall("POST", "/v1/completions", keys=keys, prompt_ids=tuple(prompt), pull=PullHint(holder, units))


def stats(llm: LLM) -> tuple[int, int]:
    s = llm.engine.stats().prefix_cache
    assert s is not None
    return s.remote_pulls, s.remote_pull_failures


def test_one_transfer_for_requests_that_wait_for_the_same_prefix(model) -> None:
    a, b = engine(model), engine(model)
    a.generate([HOLDER], SamplingParams(temperature=0, max_tokens=1))
    gate = asyncio.Event()
    holder = Holder(a, gate)
    puller = PrefixPuller("b", on(b), holder, CONFIG)
    second = SYSTEM + ids(40, 4)

    async def both() -> None:
        # the second without a hint, as the router sends it (it counts b as holding the prefix once the first went there)
        calls = [request(PULLER), dataclasses.replace(request(second), pull=None)]
        waiting = [asyncio.create_task(puller.before(c)) for c in calls]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*waiting)

    asyncio.run(both())
    assert holder.calls == 1 and stats(b) == (1, 0)
    outs = b.generate([PULLER, second], GEN)
    assert [o.num_cached_tokens for o in outs] == [192, 192]  # the first from the inbox, the second from the device after it
    asyncio.run(puller.before(request(PULLER)))  # b holds it now: no second transfer
    assert holder.calls == 1
    a.close()
    b.close()


def test_no_pull_for_a_hint_at_itself_or_less_than_a_unit_deeper(model) -> None:
    b = engine(model)
    holder = Holder(None)
    puller = PrefixPuller("b", on(b), holder, CONFIG)
    asyncio.run(puller.before(request(PULLER, holder="b")))
    b.generate([SYSTEM[:150]], SamplingParams(temperature=0, max_tokens=1))  # b holds 128 of it
    asyncio.run(puller.before(request(PULLER, units=3)))  # 192 - 128 < one unit
    assert holder.calls == 0 and stats(b) == (0, 0)
    b.close()


def test_a_replica_asked_for_a_prefix_it_is_pulling_answers_after_its_pull(model) -> None:
    """Three replicas (issue 36, 4-replica benchmark): b pulls the shared prefix from a, and c, whose hint names b (the
    replica most recently sent it), asks b while b's pull is still under way: b answers from its inbox once its pull has
    ended, so c imports it too and neither computes it. (Before, b answered nothing and c counted a failed pull.)"""
    a, b, c = engine(model), engine(model), engine(model)
    a.generate([HOLDER], SamplingParams(temperature=0, max_tokens=1))
    gate = asyncio.Event()
    b_puller = PrefixPuller("b", on(b), Holder(a, gate), CONFIG)
    asked_b = asyncio.Event()

    async def to_b(call: ReplicaCall) -> bytes | None:
        assert call.target == "b" and call.pull is not None and not asked_b.is_set()
        asked_b.set()
        return await b_puller.export(call)

    c_puller = PrefixPuller("c", on(c), to_b, CONFIG)
    third = SYSTEM + ids(45, 5)

    async def burst() -> None:
        b_pull = asyncio.create_task(b_puller.before(request(PULLER)))
        await asyncio.sleep(0)  # b's pull is under way (registered before its first await)
        c_pull = asyncio.create_task(c_puller.before(request(third, holder="b")))
        await asked_b.wait()  # c asks b while b's pull waits for a's answer
        assert not b_pull.done()
        gate.set()
        await asyncio.gather(b_pull, c_pull)

    asyncio.run(burst())
    assert stats(b) == (1, 0) and stats(c) == (1, 0)
    computing = engine(model)
    reference = computing.generate([third], GEN)[0]
    out = c.generate([third], GEN)[0]
    assert out.num_cached_tokens == 192 and list(out.token_ids) == list(reference.token_ids)
    for llm in (a, b, c, computing):
        llm.close()


@pytest.mark.parametrize("case", ["evicted", "lost", "other model"])
def test_a_pull_that_brings_nothing_is_counted_and_the_prompt_computed(model, case: str) -> None:
    b = engine(model)
    computing = engine(model)
    reference = computing.generate([PULLER], GEN)[0]
    computing.close()
    if case == "lost":
        holder = Holder(None, fail=ConnectionError("actor died"))
    else:
        other = K3ForCausalLM(debug())
        other.init_weights(seed=5 if case == "evicted" else 6)
        a = engine(other.eval())
        a.generate([HOLDER], SamplingParams(temperature=0, max_tokens=1))
        if case == "evicted":
            assert a.engine.cache.prefix is not None
            a.engine.cache.prefix.clear()
        holder = Holder(a)
    asyncio.run(PrefixPuller("b", on(b), holder, CONFIG).before(request(PULLER)))
    assert holder.calls == 1 and stats(b) == (0, 1)
    out = b.generate([PULLER], GEN)[0]
    assert out.num_cached_tokens == 0 and list(out.token_ids) == list(reference.token_ids)
    b.close()
