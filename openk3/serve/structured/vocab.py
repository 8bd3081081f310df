"""The vocabulary of a project tokenizer as the grammar engine reads it: one encoded entry per model id (xgrammar.TokenizerInfo).

Each entry is what the token writes: raw bytes (the byte tokenizer, Kimi's tiktoken ranks) or a `tokenizer.json` token in
its own encoding (byte-level BPE's printable alphabet, SentencePiece's `▁` and `<0xNN>` byte fallback). Special tokens and
ids the tokenizer does not have (a model vocabulary padded past the tokenizer's) are empty entries, which the grammar
engine never allows inside a grammar; the end tokens a request stops on are allowed once the grammar accepts
(GrammarMatcher's per-request stop tokens, serve/structured/matchers.py). The exception is `markup`: special tokens that a
tool-call grammar writes as markers (K3's `<|open|>`, `<|sep|>`, `<|close|>`) get their text as their entry, so that the
grammar lets the model write each marker as the one token the model was trained to emit instead of spelling it out.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from openk3.serve.kimi_tokenizer import KimiTokenizer
from openk3.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar


@functools.cache
def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: byte-level BPE spells each byte as one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _decoders(spec: dict[str, Any]) -> list[dict[str, Any]]:
    dec = spec.get("decoder") or {}
    return [dec, *dec.get("decoders", [])]


def _hf_entries(tok: HFTokenizer, vocab_size: int, markup: frozenset[str]) -> tuple[list[str], str, bool]:
    spec = tok.spec
    decoders = _decoders(spec)
    kinds = {d.get("type") for d in decoders}
    vocab_type = "BYTE_LEVEL" if "ByteLevel" in kinds else "BYTE_FALLBACK" if "ByteFallback" in kinds else "RAW"
    metaspace = [d for d in decoders if d.get("type") == "Metaspace"]
    add_prefix_space = any(d.get("add_prefix_space") or d.get("prepend_scheme") in ("always", "first") for d in metaspace)
    entries = [""] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=False).items():
        if i < vocab_size:
            entries[i] = text
    alphabet = _byte_level_alphabet()
    for added in spec.get("added_tokens", []):
        i, content = added["id"], added["content"]
        if i >= vocab_size:
            continue
        if added.get("special", False) and content not in markup:
            entries[i] = ""
        elif vocab_type == "BYTE_LEVEL":
            entries[i] = "".join(alphabet[b] for b in content.encode("utf-8"))
        else:
            entries[i] = content.replace(" ", "▁") if vocab_type == "BYTE_FALLBACK" else content
    return entries, vocab_type, add_prefix_space


def _kimi_entries(tok: KimiTokenizer, vocab_size: int, markup: frozenset[str]) -> list[bytes]:
    entries = [b""] * vocab_size
    for i in range(min(tok.vocab_size, vocab_size)):
        entries[i] = tok.token_bytes(i)
    for i, name in tok.special_tokens.items():
        if name in markup and i < vocab_size:
            entries[i] = name.encode("utf-8")
    return entries


def token_info(tokenizer: Tokenizer, vocab_size: int, markup: frozenset[str] = frozenset()) -> xgrammar.TokenizerInfo:
    """The grammar engine's view of `tokenizer` over a model vocabulary of `vocab_size` ids (the logits width); `markup`:
    the special tokens a grammar may write (module docstring)."""
    import xgrammar as xgr

    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"token_info: the tokenizer has {tokenizer.vocab_size} ids, more than the model's vocab_size={vocab_size}")
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    if isinstance(tokenizer, HFTokenizer):
        entries, kind, prefix = _hf_entries(tokenizer, vocab_size, markup)
        return xgr.TokenizerInfo(entries, getattr(xgr.VocabType, kind), vocab_size=vocab_size, stop_token_ids=stop, add_prefix_space=prefix)
    if isinstance(tokenizer, KimiTokenizer):
        return xgr.TokenizerInfo(_kimi_entries(tokenizer, vocab_size, markup), xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    if isinstance(tokenizer, ByteTokenizer):
        raw = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        return xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    raise TypeError(f"token_info: no grammar vocabulary for {type(tokenizer).__name__} (expected HFTokenizer, KimiTokenizer or ByteTokenizer)")
