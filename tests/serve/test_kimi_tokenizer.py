"""The Kimi tokenizer on a synthetic folder in the released layout: a BPE ranks file trained here, tokenizer_config.json with
added_tokens_decoder. Oracles: tiktoken driven directly with the same files, and the `regex` package reading the split
pattern on its own."""

from __future__ import annotations

import base64
import collections
import json
import re
from pathlib import Path

import pytest

from openk3.serve.kimi_tokenizer import KIMI_PATTERN, MAX_RUN, KimiTokenizer, TokenizerFileError, _pieces
from openk3.serve.loading import ASSETS, model_tokenizer
from openk3.serve.tokenizer import IncrementalDetokenizer, TokenizerNotFoundError, load_tokenizer

tiktoken = pytest.importorskip("tiktoken")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's the fox's day; they're all here.",
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u3002\u4e2d\u6587\u5206\u8bcd\u548c English \u6df7\u5408\u3002",
    "def main():\n    return [x * 2 for x in range(10)]  # code\n\n",
    "caf\u00e9 na\u00efve \u00fcber \u2014 1234567 tokens, emoji \U0001f600 and more text about the fox",
    "\u6a21\u578bmodel\u6a21\u578bmodel \u6a21\u578bmodel",  # the trainer learns Han+Latin merges; Kimi's split never uses them
]
SAMPLES = CORPUS + ["", "   leading and trailing   ", "\u65e5\u672c\u8a9eHelloWorld\u4e16\u754c", "\U0001f680\U0001f680 new \u00e9t\u00e9", "a\n\n\nb\tc"]
# ids after the BPE ranks, as the released tokenizer_config.json numbers them (n = the number of ranks)
RELEASED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    9: "<|im_system|>",
    13: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
# Kimi K3's own specials (the release's tokenizer_config.json numbers them 163584 + offset: [BOS] 163584, <|end_of_msg|>
# 163586, <|open|> 163587, <|close|> 163588, <|sep|> 163589, the media tokens 163602-163605, [UNK] 163838, [PAD] 163839, as
# published with the checkpoint and mirrored by vLLM's and Dynamo's K3 tests); XTML's three structure tokens are flagged
# "special": false there, so a decode that skips specials keeps them as text
K3_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
K3_PLAIN_SPECIALS = frozenset({"<|open|>", "<|close|>", "<|sep|>"})


def train_ranks(texts: list[str], merges: int) -> dict[bytes, int]:
    """A small byte-level BPE: the 256 bytes, then the most frequent adjacent pair within words, merged `merges` times."""
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(w.encode() for t in texts for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", t))
    split = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(merges):
        pairs: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        for w, parts in split.items():
            for a, b in zip(parts, parts[1:], strict=False):
                pairs[a, b] += words[w]
        candidates = [(count, pair) for pair, count in pairs.items() if pair[0] + pair[1] not in ranks]
        if not candidates:
            break
        _, (a, b) = max(candidates, key=lambda c: (c[0], [-x for x in c[1][0] + c[1][1]]))
        ranks[a + b] = len(ranks)
        for parts in split.values():
            i = 0
            while i < len(parts) - 1:
                if parts[i] == a and parts[i + 1] == b:
                    parts[i : i + 2] = [a + b]
                i += 1
    return ranks


def write_kimi_tokenizer(path: Path, merges: int = 200, eos: str = "[EOS]", specials: dict[int, str] | None = None, corpus: tuple[str, ...] = ()) -> int:
    """tiktoken.model + tokenizer_config.json in the released layout (K2's specials unless `specials` names others, e.g.
    K3_SPECIALS), its merges learnt from CORPUS and `corpus`; returns the vocabulary size (ranks + 256 specials)."""
    path.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks((CORPUS + list(corpus)) * 3, merges)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    entry = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    named = RELEASED_SPECIALS if specials is None else specials
    config = {
        "added_tokens_decoder": {str(n + i): {"content": s, **entry, "special": s not in K3_PLAIN_SPECIALS} for i, s in named.items()},
        "additional_special_tokens": [s for s in named.values() if s.startswith("<|")],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": eos,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return n + 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(folder: Path) -> KimiTokenizer:
    return KimiTokenizer(folder)


@pytest.fixture(scope="module")
def direct(folder: Path):
    """tiktoken driven directly: its own reader of the ranks file, the specials as tokenization_kimi.py numbers them."""
    from tiktoken.load import load_tiktoken_bpe

    with pytest.MonkeyPatch.context() as env:
        env.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken caches a file by its path otherwise, and pytest reuses paths
        ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    named = {int(i): e["content"] for i, e in json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding("direct", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_and_the_same_ids_as_tiktoken(tok: KimiTokenizer, direct, text: str) -> None:
    ids = tok.encode(text)
    assert ids == direct.encode(text, allowed_special="all")
    assert tok.encode_ordinary(text) == direct.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=True) == ids  # Kimi adds no BOS/EOS


def test_merges_were_learnt_and_vocab_counts_the_reserved_specials(folder: Path, tok: KimiTokenizer) -> None:
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")
    assert tok.vocab_size == tok.num_base + 256 == write_kimi_tokenizer(folder.parent / "again")
    assert (tok.bos_token_id, tok.eos_token_id) == (tok.num_base, tok.num_base + 1)


def test_split_pattern_keeps_han_runs_apart_from_latin() -> None:
    """The pattern as an independent engine (the `regex` package, set operations on) reads it."""
    regex = pytest.importorskip("regex")
    split = regex.compile(KIMI_PATTERN, flags=regex.V1).findall
    text = "Hello\u4e16\u754c\u4f60\u597dWorld's 12345 ok\u3002\u4e2d\u6587abc\n\n"
    assert split(text) == ["Hello", "\u4e16\u754c\u4f60\u597d", "World's", " ", "123", "45", " ok", "\u3002", "\u4e2d\u6587", "abc", "\n\n"]
    assert split("CamelCase HTTPServer") == ["Camel", "Case", " HTTPServer"]


def test_han_and_latin_never_share_a_token(tok: KimiTokenizer) -> None:
    han = re.compile("[\u4e00-\u9fff]")
    for text in SAMPLES:
        for t in tok.encode(text):
            piece = tok.decode([t])
            assert not (han.search(piece) and re.search("[A-Za-z]", piece)), piece


def test_special_tokens(tok: KimiTokenizer) -> None:
    n = tok.num_base
    ids = tok.encode("[BOS]hi<|im_end|>")
    assert ids[0] == n and ids[-1] == n + 2 and tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "[BOS]hi<|im_end|>"
    plain = tok.encode_ordinary("<|im_end|>")
    assert all(t < n for t in plain) and tok.decode(plain) == "<|im_end|>"  # user text never becomes a control token
    assert tok.decode([n + 100]) == "" and tok.decode([n + 100], skip_special_tokens=False) == f"<|reserved_token_{n + 100}|>"
    assert tok.encode(f"<|reserved_token_{n + 100}|>") == [n + 100]
    assert tok.special_tokens[n + 255] == "[PAD]"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_eos_comes_from_the_config(tmp_path: Path) -> None:
    write_kimi_tokenizer(tmp_path / "im_end", eos="<|im_end|>")
    tok = KimiTokenizer(tmp_path / "im_end")
    assert tok.eos_token_id == tok.num_base + 2
    write_kimi_tokenizer(tmp_path / "bad", eos="<|nope|>")
    with pytest.raises(TokenizerFileError, match=r"eos_token='<\|nope\|>' is not one of the special tokens"):
        KimiTokenizer(tmp_path / "bad")


@pytest.mark.parametrize("text", CORPUS + ["\U0001f600\U0001f680 \u4e2d\u6587\u00e9"])
def test_incremental_detokenisation(tok: KimiTokenizer, text: str) -> None:
    ids = tok.encode(text + "<|im_end|>")
    detok = IncrementalDetokenizer(tok, tok.encode("[BOS]the "))
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_long_runs_are_cut_as_kimi_cuts_them(tok: KimiTokenizer, direct) -> None:
    assert [len(p) for p in _pieces("a" * (2 * MAX_RUN + 7))] == [MAX_RUN, MAX_RUN, 7]
    assert [len(p) for p in _pieces("xy " + " " * MAX_RUN + "z")] == [3 + MAX_RUN - 1, 2]
    assert list(_pieces("")) == [] and list(_pieces("short text")) == ["short text"]
    text = "fox " + "\u4e2d" * (MAX_RUN + 3) + " the end"
    assert tok.decode(tok.encode(text)) == text
    expected = [t for p in (text[: 4 + MAX_RUN], text[4 + MAX_RUN :]) for t in direct.encode(p, allowed_special="all")]
    assert tok.encode(text) == expected


def test_bytes_per_token_bound(tok: KimiTokenizer) -> None:
    for text in SAMPLES + ["<|im_assistant|>" * 3]:
        assert len(text.encode()) <= tok.max_bytes_per_token * max(1, len(tok.encode(text)))


def test_bad_files_are_named(tmp_path: Path) -> None:
    write_kimi_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nnot-base64! 1\n")
    with pytest.raises(TokenizerFileError, match=r"tiktoken.model: line 2 is not '<base64 token> <rank>'"):
        KimiTokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b + 1}\n" for b in range(256)))
    with pytest.raises(TokenizerFileError, match=r"ranks must be 0..255"):
        KimiTokenizer(tmp_path)
    write_kimi_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["3"] = {"content": "<|in_the_bpe_range|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerFileError, match=r"added_tokens_decoder\['3'\] must name a token in \d+..\d+"):
        KimiTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json is missing"):
        load_tokenizer(tmp_path, 100_000)


def test_load_tokenizer_finds_it_and_never_falls_back(folder: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(folder, 100_000), KimiTokenizer)
    with pytest.raises(ValueError, match=r"has \d+ ids, more than the model's vocab_size=300"):
        load_tokenizer(folder, 300)
    with pytest.raises(TokenizerNotFoundError, match="looked for tokenizer.json and for tiktoken.model"):
        load_tokenizer(tmp_path, 100_000)


def test_a_checkpoint_without_a_tokenizer_is_an_error_unless_bytes_are_asked_for(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((ASSETS / "tiny" / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(ASSETS / "tiny" / "model.safetensors")
    with pytest.raises(TokenizerNotFoundError, match=str(tmp_path)):
        model_tokenizer(tmp_path, seed=0)
    assert model_tokenizer(tmp_path, seed=0, byte_tokenizer=True).vocab_size == 4100  # the demo model: 4096 + the four media tokens
