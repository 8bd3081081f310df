"""The routing rule, with exact choices: longest believed private prefix first, ties and misses to the replica sent the
fewest requests, then the least loaded, load wins over a match past the imbalance bound, a dead replica is forgotten."""

from __future__ import annotations

import pytest

from openk3.scale.prefix_table import PrefixTable, TableConfig
from openk3.serve.cache.hashing import chain_keys

SALT = b"test"


def keys(tokens: list[int]) -> list[bytes]:
    return chain_keys(SALT, tokens, 64)


SYSTEM = list(range(128))  # two match units


def test_longest_prefix_wins_and_misses_go_to_least_loaded() -> None:
    t = PrefixTable()
    t.retain(["a", "b"])
    conv = SYSTEM + list(range(500, 600))  # 228 tokens: 3 units
    assert [c.replica for c in t.rank(keys(conv), ["a", "b"])] == ["a", "b"]  # nothing cached, equal load: by id
    t.routed("a", "r1", keys(conv))
    t.routed("b", "r2", keys(SYSTEM))
    ranked = t.rank(keys(conv + list(range(700, 764))), ["a", "b"])
    assert [(c.replica, c.matched_units) for c in ranked] == [("a", 3), ("b", 2)]
    t.completed("a", "r1")
    other = list(range(900, 1000))
    # a miss: equal requests sent so far (one each), so the least loaded
    assert [c.replica for c in t.rank(keys(other), ["a", "b"])] == ["a", "b"]
    t.routed("a", "r3", keys(other))
    t.completed("b", "r2")  # a is now busier: a miss goes to b
    assert t.rank(keys(list(range(2000, 2100))), ["a", "b"])[0].replica == "b"


def test_a_match_loses_to_load_past_the_imbalance_bound() -> None:
    t = PrefixTable(TableConfig(max_imbalance=2))
    t.retain(["a", "b"])
    t.routed("a", "r0", keys(SYSTEM))
    assert t.rank(keys(SYSTEM + [1]), ["a", "b"])[0].replica == "a"  # 1 in flight over b: still within the bound
    t.routed("a", "r1", keys(SYSTEM))
    assert t.rank(keys(SYSTEM + [1]), ["a", "b"])[0].replica == "b"  # 2 over b: the match no longer counts


def test_avoid_forget_and_bound() -> None:
    t = PrefixTable(TableConfig(max_keys_per_replica=2))
    t.retain(["a", "b"])
    t.routed("a", "r0", keys(SYSTEM))
    assert [c.replica for c in t.rank(keys(SYSTEM), ["a", "b"], avoid=["a"])] == ["b", "a"]
    t.forget("a")
    assert t.depth("a", keys(SYSTEM)) == 0 and t.load("a") == 0
    long = list(range(64 * 3))
    t.routed("b", "r1", keys(long))
    assert t.depth("b", keys(long)) == 3  # the deepest key is kept (the oldest, unit 1, went)
    assert t.depth("b", keys(long[:64])) == 0
    t.retain(["b", "c"])
    assert t.replicas == ("b", "c")


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="TableConfig.max_imbalance=0"):
        TableConfig(max_imbalance=0)


def test_a_shared_system_prompt_draws_nobody_and_a_conversation_stays_home() -> None:
    """Issue 36 item 5: before, every conversation matched the shared system prompt on the replica that saw it first, so
    all of them went there. Now only the private part of a match (past the deepest branch point) draws a request."""
    t = PrefixTable()
    t.retain(["a", "b"])
    first = SYSTEM + list(range(500, 564))
    t.routed("a", "c1-t1", keys(first))
    second = SYSTEM + list(range(600, 664))  # a new conversation: it matches only the system prompt, on a
    ranked = t.rank(keys(second), ["a", "b"])
    assert t.shared_depth(keys(second)) == 2  # the system prompt's last unit is where the two conversations part
    assert [(c.replica, c.matched_units, c.private_units) for c in ranked] == [("b", 0, 0), ("a", 2, 0)]  # by load
    t.routed("b", "c2-t1", keys(second))
    t.completed("a", "c1-t1")
    turn2 = first + list(range(700, 764))  # the first conversation's next turn: its own history is on a only
    assert [(c.replica, c.private_units) for c in t.rank(keys(turn2), ["a", "b"])] == [("a", 1), ("b", 0)]


def test_conversations_sharing_a_system_prompt_spread_and_keep_their_replica() -> None:
    """The scale_routing workload in the table alone: 8 conversations x 4 turns over one system prompt, in waves of 4
    requests in flight; every conversation keeps the replica of its first turn and neither replica takes over 60%."""
    t = PrefixTable()
    t.retain(["a", "b"])
    history = {c: SYSTEM + list(range(1000 * (c + 1), 1000 * (c + 1) + 64)) for c in range(8)}
    homes: dict[int, set[str]] = {c: set() for c in range(8)}
    sent = {"a": 0, "b": 0}
    for turn in range(4):
        for wave in (range(4), range(4, 8)):
            for c in wave:
                prompt = history[c]
                chosen = t.rank(keys(prompt), ["a", "b"])[0].replica
                t.routed(chosen, f"{c}-{turn}", keys(prompt))
                homes[c].add(chosen)
                sent[chosen] += 1
                history[c] = prompt + list(range(100_000 * (turn + 1) + 64 * c, 100_000 * (turn + 1) + 64 * c + 64))
            for c in wave:
                t.completed(next(iter(homes[c])), f"{c}-{turn}")
    assert all(len(h) == 1 for h in homes.values()), homes
    assert max(sent.values()) <= 0.6 * sum(sent.values()), sent


def test_a_burst_of_new_conversations_alternates_before_any_is_reported_routed() -> None:
    """Ray asks for the choices of a burst before it reports any request routed: the first choice counts at once, and
    Ray's report, wherever the request really went, moves the count there without counting it twice."""
    t = PrefixTable()
    t.retain(["a", "b"])
    picks = []
    for c in range(4):
        prompt = keys(SYSTEM + list(range(1000 * (c + 1), 1000 * (c + 1) + 64)))
        best = t.rank(prompt, ["a", "b"])[0].replica
        t.chosen(best, f"c{c}")
        picks.append(best)
    assert picks == ["a", "b", "a", "b"]
    t.routed("b", "c0", keys(SYSTEM))  # Ray sent the first elsewhere: b now counts three, a one
    t.routed("b", "c1", keys(SYSTEM))
    assert t.rank(keys(list(range(5000, 5064))), ["a", "b"])[0].replica == "a"
    t.chosen("a", "c4")
    t.chosen("a", "c5")
    # three sent to each: then the load, and only routed requests are in flight (b: c0 and c1; a: none)
    assert t.rank(keys(list(range(6000, 6064))), ["a", "b"])[0].replica == "a"
