import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from openk3.serve.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, TokenizerNotFoundError, load_tokenizer

SAMPLES = ["plain ascii", "caf\u00e9 na\u00efve \u00fcber", "\u20ac 100 \u2014 \u65e5\u672c\u8a9e", "emoji \U0001f600\U0001f680!", ""]


def stream(tok, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip_and_incremental(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    deltas = stream(tok, ids, prompt=tok.encode("x\u00e9"))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_multibyte_character_is_held_until_complete() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    euro = list("\u20ac".encode())
    assert [detok.add(t) for t in euro] == ["", "", "\u20ac"]
    assert detok.add(ord("a")) == "a"
    detok.add(0xE2)  # an incomplete character at the very end comes out as a replacement character on flush
    assert detok.flush() == "\ufffd"


def test_byte_specials_fit_the_vocabulary() -> None:
    assert ByteTokenizer(256).eos_token_id is None
    tok = ByteTokenizer(4096)
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert tok.decode([104, 105, 257, 1000]) == "hi"
    assert tok.decode([104, 257], skip_special_tokens=False) == "h<|eos|>"
    assert tok.encode("a", add_special_tokens=True) == [256, 97]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5000])
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(100)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLES * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": {"content": "<s>"}}))
    return path


@pytest.mark.parametrize("text", SAMPLES + ["the quick brown fox"])
def test_hf_round_trip_and_incremental(hf_dir, text: str) -> None:
    tok = load_tokenizer(hf_dir, vocab_size=400)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    deltas = stream(tok, ids, prompt=tok.encode("the "))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_hf_specials(hf_dir) -> None:
    tok = HFTokenizer(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.decode(tok.encode("fox") + [1]) == "fox"
    assert tok.vocab_size <= 400


def test_no_silent_fallback_and_missing(tmp_path) -> None:
    with pytest.raises(TokenizerNotFoundError, match="looked for tokenizer.json and for tiktoken.model"):
        load_tokenizer(tmp_path, vocab_size=300)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)


def test_byte_level_bpe_reports_the_most_bytes_a_token_covers(tmp_path) -> None:
    """The size check before tokenising (api/prompt_text.py) relies on bytes <= bound * tokens for every text: checked on the
    shipped tiny tokenizer over text built to favour long tokens, added tokens and multi-byte characters; a tokenizer with
    a normalizer (which may shrink the text first) or of another model has no bound."""
    from openk3.serve.loading import ASSETS

    tok = HFTokenizer(ASSETS / "tiny")
    bound = tok.max_bytes_per_token
    assert bound is not None and bound >= max(len(c) for c in ("<|im_start|>", "<|eos|>"))
    rng = random.Random(0)
    pieces = ["the", " and", " of", "\u00e9", "\u4e2d\u6587", "\U0001f600", "<|im_start|>", "<|eos|>", " ", "\n\n", "0123456789"]
    for _ in range(50):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        assert len(text.encode("utf-8")) <= bound * len(tok.encode(text)), text[:80]
    spec = json.loads((ASSETS / "tiny" / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFKC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert HFTokenizer(tmp_path).max_bytes_per_token is None


def test_a_long_stream_decodes_whole_and_the_detokeniser_stays_small() -> None:
    tok = ByteTokenizer()
    text = "caf\u00e9 \u20ac \U0001f600 " * 200  # multi-byte characters cut across the window's compaction points
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = []
    for t in ids:
        deltas.append(detok.add(t))
        assert len(detok.token_ids) < 80  # a window, not a copy of the output
    deltas.append(detok.flush())
    assert "".join(deltas) == text
