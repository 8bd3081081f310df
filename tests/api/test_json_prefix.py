"""The JSON-object prefix reader against `json.loads` (the oracle): every prefix of a valid object is accepted whole, a
complete object is `done`, and a text is read to completion exactly when json.loads takes it as an object."""

from __future__ import annotations

import json
import random

import pytest

from openk3.api.json_prefix import JsonObjectPrefix

OBJECTS = [
    {},
    {"a": 1},
    {"city": "Paris", "days": 3, "opts": {"a": [1, True, None, -2.5e-3, 0]}, "s": 'q"\\/\n\t\u00e9\U0001f600'},
    {"nested": [[], [{}], [[1, 2], {"x": "y"}]], "e": 1e20, "neg": -0.0},
]


def reads_whole(text: str) -> bool:
    reader = JsonObjectPrefix()
    accepted, _ = reader.feed(text)
    return accepted == len(text) and reader.done


def loads_object(text: str) -> bool:
    def refuse(name: str) -> object:
        raise ValueError(name)

    try:
        return isinstance(json.loads(text, parse_constant=refuse), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("obj", OBJECTS)
@pytest.mark.parametrize("indent", [None, 2])
def test_every_prefix_of_an_object_is_accepted_and_only_the_whole_is_done(obj, indent) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    for cut in range(len(text)):
        reader = JsonObjectPrefix()
        assert reader.feed(text[:cut]) == (cut, cut) and not reader.done
    reader = JsonObjectPrefix()
    assert reader.feed(text + " \n") == (len(text) + 2, len(text)) and reader.done  # trailing whitespace is not the object's


def test_pieces_give_what_the_whole_gives() -> None:
    text = json.dumps(OBJECTS[2])
    reader = JsonObjectPrefix()
    assert sum(reader.feed(text[i : i + 3])[0] for i in range(0, len(text), 3)) == len(text) and reader.done


@pytest.mark.parametrize("seed", range(3))
def test_agrees_with_json_loads_on_mutated_texts(seed) -> None:
    rng = random.Random(seed)
    alphabet = '{}[]:,"\\ -.0123456789eEtrufalsn\n\x01ab'
    for _ in range(1500):
        text = json.dumps(rng.choice(OBJECTS))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            text = rng.choice([text[:i] + rng.choice(alphabet) + text[i:], text[:i] + text[i + 1 :]])
        assert reads_whole(text) == loads_object(text), text


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', "[1]", '"s"', '{"a": 01}', '{"a": 1,}', '{"a" 1}', '{"a": "\x01"}'])
def test_refuses_what_is_not_a_json_object(text) -> None:
    assert not reads_whole(text)
