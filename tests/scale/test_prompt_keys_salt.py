"""The router's prompt keys (scale/prompt_keys.py) with cache_salt: one salt's requests share keys, other salts (and no salt)
never do, and a salted request is not handed off to a prefill replica (its record would be keyed by no salt)."""

from __future__ import annotations

import json

from openk3.api.chat import ChatTemplate
from openk3.scale.prompt_keys import PromptKeys
from openk3.serve.tokenizer import ByteTokenizer

PATH = "/v1/completions"


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * 40, "max_tokens": 2, **fields}).encode()


def test_salted_prompts_route_by_their_own_keys() -> None:
    pk = PromptKeys(ByteTokenizer(), ChatTemplate.default(), "m", match_unit=8)
    plain, a, a_again, b = (pk.keys(PATH, body(**f)) for f in ({}, {"cache_salt": "a"}, {"cache_salt": "a"}, {"cache_salt": "b"}))
    assert len(plain) == 5 and plain == pk.keys(PATH, body())  # 41 ids (BOS + 40): five full units of 8
    assert a == a_again and len(a) == 5
    assert not set(a) & set(plain) and not set(a) & set(b)
    assert pk.cache_salt(PATH, body(cache_salt="a")) == "a" and pk.cache_salt(PATH, b"not json") is None
    ids = pk.prompt_ids(PATH, body())
    assert pk.handoff_ids(PATH, body(), ids) == ids
    assert pk.handoff_ids(PATH, body(cache_salt="a"), ids) is None
