"""The tool-call parsers on exact texts: K2 sections and K3 blocks, whole and streamed in every split, parallel calls,
malformed and truncated calls (content, never an error), names outside the tools, ids, forced calls."""

from __future__ import annotations

import json
import random

import pytest

from openk3.api.agent_output import ChoiceParser, Piece
from openk3.api.chat_format import ChatFormat, PromptEnd, forced_call_prefix
from openk3.api.tool_choice import ToolPlan

NAMES = frozenset({"get_weather", "get_time", "ns.search-v2"})
K2 = ToolPlan(ChatFormat.KIMI_K2, (), NAMES)
K3 = ToolPlan(ChatFormat.KIMI_K3, (), NAMES)
OPENED_THINK = PromptEnd(in_reasoning=True, in_response=False)
OPENED_RESPONSE = PromptEnd(in_reasoning=False, in_response=True)
NOTHING_OPEN = PromptEnd(False, False)

SEC_B, SEC_E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_B, ARGS, CALL_E = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def k2_call(name: str, idx: int, args: str) -> str:
    return f"{CALL_B}functions.{name}:{idx}{ARGS}{args}{CALL_E}"


def k3_call(name: str, idx: int, *args: tuple[str, str, str]) -> str:
    inner = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{idx}"<|sep|>{inner}<|close|>call<|sep|>'


def k3_reply(response: str, *calls: str, think: str | None = None) -> str:
    head = "" if think is None else f"{think}<|close|>think<|sep|>"
    tools = f"<|open|>tools<|sep|>{''.join(calls)}<|close|>tools<|sep|>" if calls else ""
    return f"{head}<|open|>response<|sep|>{response}<|close|>response<|sep|>{tools}<|close|>message<|sep|>"


def whole(plan: ToolPlan, end: PromptEnd, text: str, prefix: str = "") -> Piece:
    return ChoiceParser(plan, end, prefix).feed(text, final=True)


def streamed(plan: ToolPlan, end: PromptEnd, pieces: list[str], prefix: str = "") -> Piece:
    parser, out = ChoiceParser(plan, end, prefix), Piece()
    for i, text in enumerate(pieces):
        got = parser.feed(text, final=i == len(pieces) - 1)
        out.reasoning += got.reasoning
        out.content += got.content
        out.tool_calls += got.tool_calls
    return out


def splits(text: str, seed: int) -> list[list[str]]:
    """The text one character at a time, and cut at random places (markers cut anywhere)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    return [list(text) + [""], [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]]


def same(a: Piece, b: Piece) -> None:
    assert (a.reasoning, a.content) == (b.reasoning, b.content)
    assert [(c.function.name, c.function.arguments) for c in a.calls()] == [(c.function.name, c.function.arguments) for c in b.calls()]


def calls_of(p: Piece) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in p.calls()]


PARIS = ' {"city": "Paris"} '
K2_PARALLEL = f"Let me check.{SEC_B}{k2_call('get_weather', 0, PARIS)}\n{k2_call('get_time', 1, '{}')}{SEC_E}"
K3_PARALLEL = k3_reply(
    "Let me check.",
    k3_call("get_weather", 1, ("city", "string", "Paris"), ("days", "number", "1e2"), ("opts", "object", '{"a": [1, true]}')),
    k3_call("get_time", 2),
    think="The user wants weather.",
)


def test_k2_parallel_calls_with_content_before_and_model_ids() -> None:
    p = whole(K2, NOTHING_OPEN, K2_PARALLEL)
    assert p.content == "Let me check." and p.reasoning == ""
    assert calls_of(p) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [c.id for c in p.calls()] == ["functions.get_weather:0", "functions.get_time:1"]  # K2 writes these ids back into the prompt
    assert p.calls()[0].function.arguments == '{"city": "Paris"}'  # the model's own JSON, stripped (as the stream sends it)


def test_k3_typed_arguments_become_one_json_object_with_literals_kept() -> None:
    p = whole(K3, OPENED_THINK, K3_PARALLEL)
    assert p.reasoning == "The user wants weather." and p.content == "Let me check."
    assert p.calls()[0].function.arguments == '{"city": "Paris", "days": 1e2, "opts": {"a": [1, true]}}'
    assert calls_of(p)[1] == ("get_time", {})
    assert all(c.id.startswith("call_") for c in p.calls()) and len({c.id for c in p.calls()}) == 2


@pytest.mark.parametrize(("plan", "end", "text"), [(K2, NOTHING_OPEN, K2_PARALLEL), (K3, OPENED_THINK, K3_PARALLEL)], ids=["k2", "k3"])
@pytest.mark.parametrize("seed", range(4))
def test_any_split_of_the_stream_gives_the_whole_result(plan, end, text, seed) -> None:
    expected = whole(plan, end, text)
    for pieces in splits(text, seed):
        same(streamed(plan, end, pieces), expected)


def test_arguments_stream_as_they_are_written() -> None:
    parser = ChoiceParser(K2, NOTHING_OPEN)
    first = parser.feed(f"Hi{SEC_B}{CALL_B}functions.get_weather:0{ARGS}" + ' {"city": "Pa')
    assert first.content == "Hi"
    assert [(d.index, d.id, d.type, d.function.name, d.function.arguments) for d in first.tool_calls] == [
        (0, "functions.get_weather:0", "function", "get_weather", ""),
        (0, None, None, None, '{"city": "Pa'),
    ]
    rest = parser.feed('ris"} ' + CALL_E + CALL_B + "functions.get_time:1" + ARGS + "{}" + CALL_E + SEC_E, final=True)
    assert [(d.index, d.id, d.function.arguments) for d in rest.tool_calls] == [(0, None, 'ris"}'), (1, "functions.get_time:1", ""), (1, None, "{}")]
    k3 = ChoiceParser(K3, OPENED_RESPONSE)
    head = '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
    got = k3.feed(f'ok<|close|>response<|sep|><|open|>tools<|sep|>{head}Pa"r')
    assert [d.function.arguments for d in got.tool_calls] == ["", '{"city": "Pa\\"r']  # string arguments stream, escaped
    got = k3.feed('is<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3')
    assert [d.function.arguments for d in got.tool_calls] == ['is"']  # another type goes out whole, once it checks
    got = k3.feed("<|close|>argument<|sep|><|close|>call<|sep|>", final=True)
    assert [d.function.arguments for d in got.tool_calls] == [', "days": 3}']


@pytest.mark.parametrize(("plan", "end", "text"), [(K2, NOTHING_OPEN, K2_PARALLEL), (K3, OPENED_THINK, K3_PARALLEL)], ids=["k2", "k3"])
def test_every_boundary_of_a_two_piece_stream_gives_the_whole_result(plan, end, text) -> None:
    expected = whole(plan, end, text)
    for cut in range(1, len(text)):
        same(streamed(plan, end, [text[:cut], text[cut:]]), expected)


def test_arguments_that_turn_bad_end_the_call_and_the_rest_is_content() -> None:
    """What was sent of a call cannot be taken back: the call keeps it, and the rest is content (streamed or not)."""
    bad_json = f"ok{SEC_B}{k2_call('get_weather', 0, '{city: Paris}')}{SEC_E}"
    no_call_end = f"ok{SEC_B}{CALL_B}functions.get_time:0{ARGS}{{}}{SEC_E}"
    bad_number = k3_reply("ok", k3_call("get_time", 1, ("n", "number", "ten")))
    twice = k3_reply("ok", k3_call("get_time", 1, ("n", "string", "a"), ("n", "string", "b")))
    block = '<|open|>argument key="n" type="{}"<|sep|>{}<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>'
    cases = [
        (K2, bad_json, [("get_weather", "{")], f"okcity: Paris}}{CALL_E}{SEC_E}"),
        (K2, no_call_end, [("get_time", "{}")], f"ok{SEC_E}"),
        (K3, bad_number, [("get_time", '{"n": "ten"}')], "ok"),  # a value not of its type is kept as a string (SGLang's rule)
        (K3, twice, [("get_time", '{"n": "a"')], "ok" + block.format("string", "b")),
    ]
    for plan, text, calls, content in cases:
        p = whole(plan, NOTHING_OPEN, text)
        assert [(c.function.name, c.function.arguments) for c in p.calls()] == calls and p.content == content
        for pieces in splits(text, 0):
            same(streamed(plan, NOTHING_OPEN, pieces), p)


MALFORMED = [  # caught before anything of the call is sent: the whole call is content
    ("k2 not an object", K2, NOTHING_OPEN, f"ok{SEC_B}{k2_call('get_time', 0, '[1]')}{SEC_E}", f"{k2_call('get_time', 0, '[1]')}{SEC_E}"),
    ("k2 no argument marker", K2, NOTHING_OPEN, f"ok{SEC_B}{CALL_B}functions.get_time:0{{}}{CALL_E}", f"{CALL_B}functions.get_time:0{{}}{CALL_E}"),
    ("k2 unknown tool", K2, NOTHING_OPEN, f"ok{SEC_B}{k2_call('rm_rf', 0, '{}')}{SEC_E}", f"{k2_call('rm_rf', 0, '{}')}{SEC_E}"),
    ("k2 bad header", K2, NOTHING_OPEN, f"ok{SEC_B}{k2_call('get time', 0, '{}')}{SEC_E}", f"{k2_call('get time', 0, '{}')}{SEC_E}"),
    ("k3 unknown tool", K3, NOTHING_OPEN, k3_reply("ok", k3_call("rm_rf", 1)), None),
    ("k3 garbage in the tools block", K3, NOTHING_OPEN, k3_reply("ok").replace("<|close|>message", "<|open|>tools<|sep|>nonsense<|close|>message"), None),
]


@pytest.mark.parametrize(("plan", "end", "text", "tail"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_call_and_what_follows_is_content(plan, end, text, tail) -> None:
    p = whole(plan, end, text)
    assert p.calls() == []
    assert p.content.startswith("ok") and len(p.content) > 2  # the model's text is all there, markers included
    if tail is not None:
        assert p.content == "ok" + tail
    for pieces in splits(text, 0):
        same(streamed(plan, end, pieces), p)


def test_an_earlier_good_call_survives_a_later_malformed_one() -> None:
    text = f"{SEC_B}{k2_call('get_time', 0, '{}')}{k2_call('get_weather', 1, 'nope')}{SEC_E}"
    p = whole(K2, NOTHING_OPEN, text)
    assert calls_of(p) == [("get_time", {})] and p.content == f"{k2_call('get_weather', 1, 'nope')}{SEC_E}"


@pytest.mark.parametrize(("plan", "end", "text"), [(K2, NOTHING_OPEN, K2_PARALLEL), (K3, OPENED_THINK, K3_PARALLEL)], ids=["k2", "k3"])
def test_a_reply_cut_inside_a_call_keeps_the_complete_calls_and_the_rest_is_content(plan, end, text) -> None:
    cut = text[: text.index("get_time") + len("get_time") + 4]  # inside the second call
    p = whole(plan, end, cut)
    assert [c.function.name for c in p.calls()] == ["get_weather"]
    if plan is K3:  # K3's cut markup is dropped (SGLang's K3 detector: a cut call header yields no call and no text)
        assert p.content == "Let me check."
    else:
        assert p.content.startswith("Let me check.") and p.content.endswith(cut[-12:])  # the cut call, as written
    for pieces in splits(cut, 1):
        same(streamed(plan, end, pieces), p)


def test_dotted_and_dashed_names_and_a_bare_call_without_section() -> None:
    p = whole(K2, NOTHING_OPEN, k2_call("ns.search-v2", 3, '{"q": "x"}'))
    assert calls_of(p) == [("ns.search-v2", {"q": "x"})] and p.calls()[0].id == "functions.ns.search-v2:3"


def test_repeated_indices_still_get_distinct_ids() -> None:
    p = whole(K2, NOTHING_OPEN, SEC_B + k2_call("get_time", 0, "{}") + k2_call("get_time", 0, "{}") + SEC_E)
    assert [c.id for c in p.calls()] == ["functions.get_time:0", "functions.get_time:0-2"]


def test_without_tools_k2_sections_are_plain_text_and_k3_tools_blocks_are_dropped() -> None:
    none_k2 = ToolPlan(ChatFormat.KIMI_K2)
    assert whole(none_k2, NOTHING_OPEN, K2_PARALLEL).content == K2_PARALLEL
    none_k3 = ToolPlan(ChatFormat.KIMI_K3)
    p = whole(none_k3, NOTHING_OPEN, k3_reply("just text", k3_call("get_time", 1)))
    assert p.calls() == [] and p.content == "just text"  # K3 markup for tools nobody offered is dropped, not content


def test_forced_calls_start_inside_the_arguments() -> None:
    k2_prefix = forced_call_prefix(ChatFormat.KIMI_K2, OPENED_THINK, "get_weather", 4)
    assert k2_prefix == f"</think>{SEC_B}{CALL_B}functions.get_weather:4{ARGS}"
    p = whole(K2, OPENED_THINK, '{"city": "Oslo"}' + CALL_E + SEC_E, k2_prefix)
    assert p.reasoning == "" and p.content == "" and p.calls()[0].id == "functions.get_weather:4"
    k3_prefix = forced_call_prefix(ChatFormat.KIMI_K3, OPENED_THINK, "get_weather", 0)
    assert k3_prefix.startswith("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>")
    reply = '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>'
    p = whole(K3, OPENED_THINK, reply, k3_prefix)
    assert calls_of(p) == [("get_weather", {"city": "Oslo"})] and p.content == "" and p.reasoning == ""


def test_parallel_false_closes_the_call_the_stop_string_cut() -> None:
    plan = ToolPlan(ChatFormat.KIMI_K2, (), NAMES, parallel=False)
    assert plan.call_stop() == CALL_E
    parser = ChoiceParser(plan, NOTHING_OPEN)
    p = parser.feed(f"{SEC_B}{CALL_B}functions.get_time:0{ARGS}{{}}", final=True, stop_reason=CALL_E)
    assert calls_of(p) == [("get_time", {})] and parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


def test_sglang_k3_detector_edge_cases() -> None:
    """The cases of SGLang's K3 detector tests (test_kimik3_detector.py) where openk3 had differed, whole and streamed at
    every split: a value not of its type is kept as a string; the end of a reply inside markup never leaks it."""
    tools = "<|open|>tools<|sep|>"
    bad_object = k3_reply("", k3_call("get_time", 1, ("n", "number", "42"), ("flag", "boolean", "true"), ("bad", "object", "{not json")))
    cut_argument = tools + '<|open|>call tool="get_time" index="1"<|sep|><|open|>argument key="q" type="string"<|sep|>print(1<|close|>argu'
    prefixes = tools + k3_call("get_time", 1, ("q", "string", "<|close|>arg <| x <|sep")) + "<|close|>tools<|sep|>"
    cases = [  # (where the prompt left off, text, content, [(name, arguments)])
        (NOTHING_OPEN, bad_object, "", [("get_time", '{"n": 42, "flag": true, "bad": "{not json"}')]),
        (OPENED_RESPONSE, "all done<|open|>", "all done", []),  # a stream that ends on a cut <|open|> does not leak it
        (OPENED_RESPONSE, "all done<", "all done<", []),  # a bare "<" is text
        (NOTHING_OPEN, tools + '<|open|>call tool="get_ti', "", []),  # a cut call header yields no call, and no markup
        (NOTHING_OPEN, cut_argument, "", [("get_time", '{"q": "print(1')]),  # what was sent stays; the cut marker does not
        (NOTHING_OPEN, prefixes, "", [("get_time", json.dumps({"q": "<|close|>arg <| x <|sep"}))]),
    ]
    for end, text, content, calls in cases:
        p = whole(K3, end, text)
        assert (p.content, [(c.function.name, c.function.arguments) for c in p.calls()]) == (content, calls), text
        for pieces in splits(text, 2):
            same(streamed(K3, end, pieces), p)


def test_reserved_special_tokens_never_reach_the_client_as_text() -> None:
    """K3 replies are decoded with special tokens kept (the parsers read the markers); any other special token's text
    (`<|reserved_token_N|>`, `[UNK]`) is dropped, also when a stream cuts it, and `[` or `<` alone stay text."""
    hidden = frozenset({"<|reserved_token_163600|>", "[UNK]", "[BOS]"})
    text = k3_reply("a<|reserved_token_163600|>b [UNK]c[d <e", k3_call("get_time", 1, ("q", "string", "x[UNK]y")), think="t[BOS]")
    for pieces in [[text], *splits(text, 3)]:
        parser, out = ChoiceParser(K3, OPENED_THINK, "", hidden), Piece()
        for i, piece in enumerate(pieces):
            got = parser.feed(piece, final=i == len(pieces) - 1)
            out.reasoning, out.content, out.tool_calls = out.reasoning + got.reasoning, out.content + got.content, out.tool_calls + got.tool_calls
        assert (out.reasoning, out.content, calls_of(out)) == ("t", "ab c[d <e", [("get_time", {"q": "xy"})])
