"""The router's half of the cross-replica prefix pull: which replica to pull from (pull_hints.py), the hint written into
the call Ray sends (router.py, with a fake pending request), and when pulls are on (deploy.pulls_on)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray", reason="ray[serve] is not installed (the `ray` extra)")

from openk3.launch.replicas import replica_launch  # noqa: E402
from openk3.scale.calls import PullHint, ReplicaCall  # noqa: E402
from openk3.scale.deploy import ScaleConfig, pulls_on  # noqa: E402
from openk3.scale.pull_hints import PullHints  # noqa: E402
from openk3.scale.router import PrefixAffinityRouter  # noqa: E402
from openk3.serve.cache.hashing import chain_keys  # noqa: E402

SYSTEM = list(range(320))  # five match units shared by every conversation


def keys(tokens: list[int]) -> tuple[bytes, ...]:
    return tuple(chain_keys(b"test", tokens, 64))


def conv(c: int, n: int = 100) -> tuple[bytes, ...]:
    return keys(SYSTEM + [1000 + c] * n)


def test_the_deepest_holder_other_than_the_landing_replica() -> None:
    h = PullHints()
    assert h.hint(conv(0), "b", ["a", "b"]) is None  # nobody holds anything
    h.sent("a", conv(0))
    assert h.hint(conv(1), "b", ["a", "b"]) == PullHint("a", 5)  # the shared system prompt, five units
    assert h.hint(conv(1), "a", ["a", "b"]) is None  # a holds it itself
    assert h.hint(conv(0), "b", ["a", "b"]) == PullHint("a", 6)  # conv 0's own unit too
    h.sent("b", conv(1))
    assert h.hint(conv(2), "b", ["a", "b"]) is None  # b holds the shared part now: nothing deeper elsewhere
    assert h.hint(conv(0), "b", ["a", "b"]) == PullHint("a", 6)  # one unit past b's five
    assert h.hint(conv(0), "b", ["b"]) is None  # a is not in the set (dead, or left)


def test_min_units_and_the_most_recent_holder() -> None:
    h = PullHints(min_units=2)
    h.sent("b", keys(SYSTEM[:256]))  # b: four units
    h.sent("a", conv(0))
    assert h.hint(conv(0), "b", ["a", "b"]) == PullHint("a", 6)  # two units past b's
    assert h.hint(keys(SYSTEM + [7] * 10), "b", ["a", "b"]) is None  # a is one unit deeper: not worth a pull
    h.sent("c", conv(0))
    assert h.hint(conv(0), "b", ["a", "b", "c"]) == PullHint("c", 6)  # the replica that took it last
    assert h.hint(conv(0), "b", ["a", "b"]) == PullHint("a", 6)


def test_forget_retain_and_bound() -> None:
    h = PullHints(max_keys=8)
    h.sent("a", conv(0))  # six keys
    h.sent("c", conv(1, 64))  # the five shared ones again, and one of its own
    assert len(h) == 7
    h.forget("c")
    assert h.hint(conv(1), "b", ["a", "b", "c"]) == PullHint("a", 5)
    h.retain(["b"])
    assert len(h) == 0
    h.sent("a", conv(0))
    h.sent("a", keys(list(range(5000, 5000 + 64 * 4))))  # four more: the oldest keys go
    assert len(h) == 8  # the two oldest keys went: a request of just those two units finds no holder
    assert h.hint(keys(SYSTEM[:128]), "b", ["a", "b"]) is None
    assert h.hint(conv(0), "b", ["a", "b"]) == PullHint("a", 6)  # a deeper key stands for the whole prefix (chained keys)


@dataclass
class FakePending:
    args: list[Any]
    metadata: Any = field(default_factory=lambda: SimpleNamespace(internal_request_id="r"))
    routing_context: Any = field(default_factory=lambda: SimpleNamespace(should_backoff=False))


def router(pull_min_units: int | None) -> PrefixAffinityRouter:
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the rule only: no Ray controller behind it
    r.initialize_state(pull_min_units=pull_min_units)
    return r


@pytest.mark.parametrize("ids", [(1, 2, 3), ()])
def test_the_router_writes_the_hint_into_the_call_it_sends(ids: tuple[int, ...]) -> None:
    r = router(1)
    assert r.pulls is not None
    r.pulls.sent("a", conv(0))
    call = ReplicaCall("POST", "/v1/chat/completions", keys=conv(1), prompt_ids=ids)
    pending = FakePending([call])
    r._hint(pending, call, "b", ["a", "b"])  # type: ignore[arg-type]
    # with its prompt ids (the front end sends them when pulls are on) the call names a; without, it is left alone
    assert pending.args[0].pull == (PullHint("a", 5) if ids else None)
    assert r.pulls.hint(conv(1), "a", ["a", "b"]) == (PullHint("b", 6) if ids else None)  # b counts as holding conv 1 now


def test_no_pulls_no_hints() -> None:
    r = router(None)
    call = ReplicaCall("POST", "/v1/completions", keys=conv(1), prompt_ids=(1, 2))
    pending = FakePending([call])
    r._hint(pending, call, "b", ["a", "b"])  # type: ignore[arg-type]
    assert r.pulls is None and pending.args[0] is call


ARGV = ["--model", "tiny", "--enable-prefix-caching"]


def test_when_pulls_are_on() -> None:
    one = replica_launch(ARGV)
    assert pulls_on(one, ScaleConfig(replicas=2))
    assert not pulls_on(one, ScaleConfig(replicas=2, prefix_pull=False))
    assert not pulls_on(one, ScaleConfig(replicas=2, router="pow2"))
    assert not pulls_on(one, ScaleConfig(replicas=1, prefill_replicas=1))
    with pytest.raises(ValueError, match="needs --replica-router prefix"):
        pulls_on(one, ScaleConfig(replicas=2, router="pow2", prefix_pull=True))
    with pytest.raises(ValueError, match="prefill replica"):
        pulls_on(one, ScaleConfig(replicas=1, prefill_replicas=1, prefix_pull=True))
    two_ranks = replica_launch(argparse.Namespace(**{**vars(one.serve_args), "ep": 2}))
    assert not pulls_on(two_ranks, ScaleConfig(replicas=2))
    with pytest.raises(ValueError, match="2 ranks"):
        pulls_on(two_ranks, ScaleConfig(replicas=2, prefix_pull=True))
