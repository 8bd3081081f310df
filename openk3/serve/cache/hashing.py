"""Prefix keys: chained page hashes over token ids, salted with everything that changes the cached state.

A page key is blake2b(previous key || the page's token ids), starting from the salt, so equal keys mean equal token
prefixes (up to a 128-bit collision) under the same model. A snapshot at a boundary p that is not a page end is keyed by
its anchor (the key of the last full page before p) and the tail tokens after it. Keys are stable across processes (no
Python `hash`), so disk-tier files written under one salt are never read under another model or weights. A request's
`cache_salt` (vLLM's) is mixed into the salt its chain starts from (`request_salt`), so requests with different salts never
share a cached prefix, in any tier, and requests with the same salt do.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import torch

from openk3.config import ModelConfig

DIGEST = 16


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def model_salt(config: ModelConfig, model: torch.nn.Module | None, cache_dtype: torch.dtype, fp8_latent: bool = False) -> bytes:
    """Salt of the cache keys: the config, the cache dtype and format and a fingerprint of the weights (shape, sum, first
    values per parameter), so two checkpoints of one architecture, or two cache formats, never share cached states."""
    h = hashlib.blake2b(digest_size=DIGEST)
    h.update(repr(config).encode())
    h.update(str(cache_dtype).encode())
    if fp8_latent:
        h.update(b"mla-latent:fp8-e4m3")
    if model is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                flat = p.detach().reshape(-1)
                head = flat[:8].float().cpu().tolist()
                h.update(f"{name}:{tuple(p.shape)}:{float(flat.float().sum()):.9e}:{head}".encode())
    return h.digest()


def request_salt(model_salt: bytes, cache_salt: str | None) -> bytes:
    """The salt a request's keys chain from: the model's, or for a request with a `cache_salt` the model's mixed with it."""
    if cache_salt is None:
        return model_salt
    return hashlib.blake2b(model_salt + b"cache_salt\x00" + cache_salt.encode(), digest_size=DIGEST).digest()


def page_key(parent: bytes, page_tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + _tokens_bytes(page_tokens), digest_size=DIGEST).digest()


def chain_keys(salt: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Key of each full page of `tokens` (a trailing partial page gets none)."""
    keys, parent = [], salt
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_key(parent, tokens[start : start + page_size])
        keys.append(parent)
    return keys


def snapshot_key(anchor: bytes, tail: Sequence[int]) -> bytes:
    """Key of the state at the boundary `anchor` + `tail` (tail: the tokens after the last full page, possibly none)."""
    return hashlib.blake2b(b"snapshot" + anchor + _tokens_bytes(tail), digest_size=DIGEST).digest()
