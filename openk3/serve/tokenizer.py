"""Tokenizers the engine can use, and incremental detokenisation.

`Tokenizer` is the interface: encode, decode, eos/bos ids, vocab size, and for chat prompts the special-token strings its
encode reads as control tokens with `encode_with_plain`, which reads them only outside spans of request text
(api/user_text.py). `HFTokenizer` wraps a `tokenizer.json` through the
`tokenizers` package; `KimiTokenizer` (serve/kimi_tokenizer.py) a Kimi `tiktoken.model`; `ByteTokenizer`, used only where asked
for (random-weight presets, tests, a caller's explicit choice): ids 0..255 are the raw bytes, then a few specials, and any
other id the model's vocabulary has is a reserved token with no text. `IncrementalDetokenizer` turns a growing token list into text
deltas that never end inside a UTF-8 character: it decodes a short window of recent tokens and holds the text back while the
window ends in a replacement character (an incomplete byte sequence), the scheme vLLM uses.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from openk3.checks import fail
from openk3.serve.kimi_tokenizer import RANKS_FILE, KimiTokenizer

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def special_token_strings(self) -> frozenset[str]: ...

    def encode_with_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]: ...


class ByteTokenizer:
    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
    max_bytes_per_token = 1  # one id per UTF-8 byte; its encode reads no special tokens out of the text (api/prompt_text.py)

    def __init__(self, vocab_size: int = 256 + len(SPECIALS)) -> None:
        if vocab_size < 256:
            fail("ByteTokenizer", "vocab_size", vocab_size, ">= 256 (one id per byte)")
        self._vocab_size = vocab_size
        # Specials only exist where the vocabulary has room for them.
        self._specials = {256 + i: s for i, s in enumerate(self.SPECIALS) if 256 + i < vocab_size}
        self._by_name = {s: i for i, s in self._specials.items()}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self._by_name.get("<|eos|>")

    @property
    def bos_token_id(self) -> int | None:
        return self._by_name.get("<|bos|>")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    @property
    def special_token_strings(self) -> frozenset[str]:
        return frozenset()  # encode spells every text out byte by byte: no string is a control token

    def encode_with_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        return self.encode(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in token_ids:
            if not 0 <= t < self._vocab_size:
                raise ValueError(f"ByteTokenizer.decode: token id {t} outside the vocabulary 0..{self._vocab_size - 1}")
            if t < 256:
                out.append(t)
            elif not skip_special_tokens and t in self._specials:
                out.extend(self._specials[t].encode())
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (and, when present beside it, `tokenizer_config.json` for the eos/bos names)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}")
        self._tok = _Tok.from_file(str(file))
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self._eos = self._special_id(config.get("eos_token"))
        self._bos = self._special_id(config.get("bos_token"))

    def _special_id(self, entry: str | dict | None) -> int | None:
        if isinstance(entry, dict):
            entry = entry.get("content")
        return None if entry is None else self._tok.token_to_id(entry)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch, not encode: the same ids, but it releases the GIL while it works (encode holds it throughout, so a
        # multi-MB prompt tokenised on a server's worker thread froze the event loop and the engine thread with it)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def spec(self) -> dict[str, Any]:
        """The tokenizer.json document (model, pre-tokenizer, decoder, added tokens), for readers of its vocabulary."""
        return json.loads(self._tok.to_str())

    def get_vocab(self, with_added_tokens: bool = False) -> dict[str, int]:
        """Token text (in the model's own encoding: byte-level alphabet, SentencePiece's ▁) -> id."""
        return self._tok.get_vocab(with_added_tokens=with_added_tokens)

    @functools.cached_property
    def special_token_strings(self) -> frozenset[str]:
        """The added tokens flagged special: encode reads them out of any text as their ids."""
        return frozenset(t["content"] for t in self.spec.get("added_tokens", []) if t.get("special"))

    @functools.cached_property
    def _plain_tok(self) -> Any:
        """A second tokenizer that reads special-token strings as text (the `tokenizers` flag is per tokenizer object, so the
        shared one is never switched while another thread encodes)."""
        from tokenizers import Tokenizer as _Tok

        tok = _Tok.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_with_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        """As `encode` (no added BOS/EOS), except that a special token overlapping a `plain` span is read as text. Without
        spans exactly `encode`; with them the text is cut at the special tokens that stay special (where `encode` cuts it
        too) and the rest encoded by the tokenizer that reads specials as text."""
        if not plain:
            return self.encode(text)
        names = sorted(self.special_token_strings, key=len, reverse=True)
        if not names:
            return self.encode(text)
        pieces: list[str] = []
        special: list[int] = []
        pos = 0
        for m in re.finditer("|".join(re.escape(n) for n in names), text):
            if any(a < m.end() and m.start() < b for a, b in plain):
                continue
            token_id = self._tok.token_to_id(m.group())
            assert token_id is not None, "an added token has an id"
            pieces.append(text[pos : m.start()])
            special.append(token_id)
            pos = m.end()
        pieces.append(text[pos:])
        encoded = self._plain_tok.encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = []
        for k, enc in enumerate(encoded):
            ids += enc.ids
            if k < len(special):
                ids.append(special[k])
        return ids

    @functools.cached_property
    def max_bytes_per_token(self) -> int | None:
        """The most UTF-8 input bytes one token can stand for, when that is certain: a byte-level BPE without a normalizer
        (which could shrink the text before it is split) reads every input byte into exactly one vocabulary character, so a
        token covers at most its own length in input bytes, and an added token its content's bytes. None otherwise."""
        spec = self.spec
        pre = spec.get("pre_tokenizer") or {}
        byte_level = pre.get("type") == "ByteLevel" or any(p.get("type") == "ByteLevel" for p in pre.get("pretokenizers", []))
        if spec.get("normalizer") is not None or not byte_level or spec["model"].get("type") != "BPE":
            return None
        vocab = spec["model"]["vocab"]
        added = [len(t["content"].encode("utf-8")) for t in spec.get("added_tokens", [])]
        return max([len(token) for token in vocab] + added)


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model + tokenizer_config.json")


class TokenizerNotFoundError(FileNotFoundError):
    """A folder with no tokenizer openk3 can load; the message names the files looked for."""


def load_tokenizer(path: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer of a checkpoint folder: its tokenizer.json (the `tokenizers` package), else a Kimi tiktoken.model with
    its tokenizer_config.json (serve/kimi_tokenizer.py). Never a silent fallback: without either it is an error, and the byte
    tokenizer is only used where a caller asks for it. `vocab_size` is the model's: a tokenizer with more ids is an error."""
    path = Path(path)
    tokenizer: Tokenizer
    if (path / "tokenizer.json").is_file() or (path.is_file() and path.name.endswith(".json")):
        tokenizer = HFTokenizer(path)
    elif (path / RANKS_FILE).is_file():
        tokenizer = KimiTokenizer(path)
    else:
        raise TokenizerNotFoundError(
            f"no tokenizer in {path}: looked for {' and for '.join(TOKENIZER_FILES)}; "
            "to run it without one, pass a tokenizer (LLM(path, tokenizer)) or serve it with the byte tokenizer (openk3 serve --tokenizer byte)"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer in {path} has {tokenizer.vocab_size} ids, more than the model's vocab_size={vocab_size}")
    return tokenizer


class IncrementalDetokenizer:
    """Text of a growing token list, emitted in deltas that are always whole characters.

    prefix_offset..read_offset is a window of tokens already emitted, decoded again with the new tokens so that tokenizers
    whose text depends on the neighbour (leading spaces, byte fallback) render the new tokens as they would in the full text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids or [])[-5:]  # a few prompt tokens give the first output its context
        self.read_offset = len(self.token_ids)
        self.prefix_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            if self.prefix_offset >= 64:
                # Only the window from prefix_offset is ever decoded again: drop what lies before it, so the detokeniser holds
                # a few tokens, not a second copy of the request's output.
                del self.token_ids[: self.prefix_offset]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """The held-back text at the end of generation (an incomplete character comes out as a replacement character)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]
