"""The Kimi tokenizer (K2, Kimi-Linear, K3): a `tiktoken.model` BPE ranks file and `tokenizer_config.json`, run by `tiktoken`.

Released layout: `tiktoken.model` has one `<base64 bytes> <rank>` line per token, ranks 0..n-1 (n = 163584 in the releases);
256 special ids follow, n..n+255. `tokenizer_config.json` names some of them in `added_tokens_decoder` (`{"163584": {"content":
"[BOS]", "special": true, ...}}`) and says which is `bos_token` / `eos_token`; an unnamed id is `<|reserved_token_{id}|>`, as
Moonshot's `tokenization_kimi.py` calls it. `vocab_size` counts the specials (163840 for the releases).

What `encode(text, add_special_tokens)` means, matching the HF tokenizer (`AutoTokenizer` with Moonshot's remote code):
- special-token strings in `text` (`<|im_end|>`, `[EOS]`, ...) become their ids whatever `add_special_tokens` says: HF splits
  the text on its added tokens before BPE, and a rendered chat template is text whose markers must become ids;
- `add_special_tokens=True` adds nothing: Kimi's tokenizer defines no BOS/EOS post-processing (its
  `build_inputs_with_special_tokens` is the identity), and its chat template writes every marker itself.
User or tool text that must never turn into control tokens goes through `encode_ordinary` instead (tiktoken's name): there a
special-token string is plain text, split by BPE like any other, which is how Kimi's K3 chat encoder treats message content.
A rendered chat prompt mixes both: `encode_with_plain` reads special tokens only outside the given spans of request text.
`decode(skip_special_tokens=True)` drops every special id (those `added_tokens_decoder` flags `special`, and the reserved ones).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

NUM_RESERVED_SPECIAL = 256
RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# Kimi's pre-tokenizer split (the `pat_str` of Moonshot's tokenization_kimi.py for Kimi K2, Kimi-Linear and K3), written out
# here from that description: the o200k pattern's cased-letter runs with Han characters taken out of every letter class
# (`&&[^\p{Han}]`, a character-class intersection the fancy-regex engine inside tiktoken supports) and a first alternative
# that keeps a run of Han characters together, so Chinese text is never glued to a neighbouring Latin word or punctuation.
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join(
    (
        r"[\p{Han}]+",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}",
        rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)
# Kimi's tokenizer encodes at most 400k characters per tiktoken call, and cuts runs of whitespace or of non-whitespace longer
# than 25k characters (tiktoken's regex backtracks badly on them, openai/tiktoken#195); the same cuts give the same ids.
MAX_CHARS = 400_000
MAX_RUN = 25_000


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be read as the Kimi layout: the message names the file and what is wrong."""


def read_ranks(file: Path) -> dict[bytes, int]:
    """`<base64 token> <rank>` lines; ranks must be exactly 0..n-1 (the special ids start at n) and cover every byte.
    Read here rather than by tiktoken.load, which copies a file into a temp-dir cache keyed by its path and reuses it."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(file.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise TokenizerFileError(f"{file}: line {number} is not '<base64 token> <rank>' ({e})") from None
        if token in ranks:
            raise TokenizerFileError(f"{file}: line {number} repeats the token {token!r}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerFileError(f"{file}: ranks must be 0..{len(ranks) - 1}, each once (the special ids follow them)")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerFileError(f"{file}: single bytes {missing[:8]} have no rank; every byte must be a token")
    return ranks


def _content(entry: Any) -> str | None:
    return entry.get("content") if isinstance(entry, dict) else entry


class KimiTokenizer:
    def __init__(self, path: str | Path) -> None:
        import tiktoken

        path = Path(path)
        ranks_file, config_file = path / RANKS_FILE, path / CONFIG_FILE
        for file in (ranks_file, config_file):
            if not file.is_file():
                raise FileNotFoundError(f"Kimi tokenizer at {path}: {file.name} is missing (expected {RANKS_FILE} and {CONFIG_FILE})")
        ranks = read_ranks(ranks_file)
        config = json.loads(config_file.read_text())
        self.num_base = len(ranks)
        self._names, self._special_ids = self._specials(config, config_file)
        self._enc = tiktoken.Encoding(
            name=path.name or "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={s: i for i, s in self._names.items()}
        )
        self._bos = self._config_id(config, "bos_token", "[BOS]", config_file)
        self._eos = self._config_id(config, "eos_token", "[EOS]", config_file)

    def _specials(self, config: dict[str, Any], file: Path) -> tuple[dict[int, str], frozenset[int]]:
        first, end = self.num_base, self.num_base + NUM_RESERVED_SPECIAL
        names = {i: f"<|reserved_token_{i}|>" for i in range(first, end)}
        plain: set[int] = set()  # added tokens flagged "special": false keep their text on decode
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            token_id, content = int(key) if str(key).isdigit() else -1, _content(entry)
            if not first <= token_id < end or not isinstance(content, str) or not content:
                raise TokenizerFileError(f"{file}: added_tokens_decoder[{key!r}] must name a token in {first}..{end - 1} (after the BPE ranks)")
            names[token_id] = content
            if isinstance(entry, dict) and entry.get("special") is False:
                plain.add(token_id)
        if len(set(names.values())) != len(names):
            raise TokenizerFileError(f"{file}: added_tokens_decoder names one token twice")
        return names, frozenset(names) - plain

    def _config_id(self, config: dict[str, Any], field: str, default: str, file: Path) -> int | None:
        name = _content(config.get(field))
        by_name = {s: i for i, s in self._names.items()}
        if name is None:
            return by_name.get(default)  # tokenization_kimi.py's defaults
        if name not in by_name:
            raise TokenizerFileError(f"{file}: {field}={name!r} is not one of the special tokens of added_tokens_decoder")
        return by_name[name]

    @property
    def vocab_size(self) -> int:
        return self.num_base + NUM_RESERVED_SPECIAL

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def special_tokens(self) -> dict[int, str]:
        return dict(self._names)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` become their ids; `add_special_tokens` adds no BOS/EOS (module docstring)."""
        return [t for piece in _pieces(text) for t in self._enc.encode(piece, allowed_special="all")]

    def encode_ordinary(self, text: str) -> list[int]:
        """`text` as plain text: a special-token string in it is split by BPE like any other text, never a control id."""
        return [t for piece in _pieces(text) for t in self._enc.encode_ordinary(piece)]

    @functools.cached_property
    def special_token_strings(self) -> frozenset[str]:
        """The strings `encode` turns into special ids."""
        return frozenset(self._names.values())

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(re.escape(s) for s in sorted(self._names.values(), key=len, reverse=True)))

    def encode_with_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        """As `encode`, except that a special-token string overlapping a `plain` span (character ranges of request text in a
        rendered prompt, api/user_text.py) is ordinary text; without spans exactly `encode`."""
        if not plain:
            return self.encode(text)
        by_name = {s: i for i, s in self._names.items()}
        ids: list[int] = []
        pos = 0
        for m in self._special_pattern.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in plain):
                continue
            ids += self.encode_ordinary(text[pos : m.start()])
            ids.append(by_name[m.group()])
            pos = m.end()
        return ids + self.encode_ordinary(text[pos:])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token writes (empty for special ids): what a grammar engine matches the output's text against."""
        if token_id < self.num_base:
            return self._enc.decode_single_token_bytes(token_id)
        return self.decode([token_id], skip_special_tokens=True).encode("utf-8")  # a plain added token keeps its text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"KimiTokenizer.decode: token id {bad} outside the vocabulary 0..{self.vocab_size - 1}")
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self._special_ids]
        return self._enc.decode(token_ids, errors="replace")

    @functools.cached_property
    def max_bytes_per_token(self) -> int:
        """The most UTF-8 input bytes one token stands for: tiktoken reads every input byte into exactly one token and has no
        normalizer, so it is the longest rank's bytes or special token's content (api/prompt_text.py's size bound)."""
        longest = max(len(b) for b in self._enc.token_byte_values())
        return max([longest] + [len(s.encode("utf-8")) for s in self._names.values()])


_RUN = re.compile(r"\s+|\S+")  # Python's \s is exactly str.isspace, which Kimi's cutter uses


def _pieces(text: str) -> Iterator[str]:
    """`text` in slices of MAX_CHARS, each cut so that no run of whitespace or of non-whitespace is longer than MAX_RUN: a
    longer run is cut after every MAX_RUN characters. Short text is one piece; empty text none."""
    for offset in range(0, len(text), MAX_CHARS):
        chunk, start = text[offset : offset + MAX_CHARS], 0
        for run in _RUN.finditer(chunk):
            for cut in range(run.start() + MAX_RUN, run.end(), MAX_RUN):
                yield chunk[start:cut]
                start = cut
        yield chunk[start:]
