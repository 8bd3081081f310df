"""The encoder cache: each image's projected embeddings, computed once and kept by image digest, and the step's image rows.

A step's chunk of a request may cover any part of an image's tokens (chunked prefill may cut inside an image; a prefix hit
may end inside one): its rows take the matching rows of the image's embeddings, so no split breaks the state. The encoder
runs once per image not in the cache, for all such images of the step in one call (the tower packs them). The cache is
an LRU bounded in embedding rows; an entry a later chunk needs again after eviction (a preempted request, a long prompt)
is recomputed from the pixels its request keeps, so eviction costs time, never correctness. The scheduler charges a
chunk's not-yet-encoded images to the step's token budget (`cost`).
Not thread-safe: the engine's thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from openk3.checks import check_int
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.request import Request

Encode = Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor]  # K3ForCausalLM.encode_images


class EncoderCache:
    def __init__(self, encode: Encode, capacity_rows: int, device: torch.device) -> None:
        check_int("EncoderCache", "capacity_rows", capacity_rows, low=1)
        self.encode, self.capacity_rows, self.device = encode, capacity_rows, device
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # digest -> [N, D], least recently used first
        self.rows = 0
        self.encoded_images = 0  # images run through the encoder (a hit runs none)
        self.hits = 0

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.entries

    def cost(self, req: Request, n: int) -> int:
        """Image tokens that computing [num_computed, + n) of `req` would encode first (the scheduler's budget charge)."""
        return sum(s.image.num_tokens for s in _overlapping(req.images, req.num_computed_tokens, n) if s.image.digest not in self.entries)

    def embeddings(self, spans: Sequence[ImageSpan]) -> dict[bytes, torch.Tensor]:
        """The embeddings of these images, running the encoder once for those not cached (one packed call)."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageSpan] = {}
        for s in spans:
            d = s.image.digest
            if d in found or d in missing:
                continue
            if d in self.entries:
                self.entries.move_to_end(d)
                found[d] = self.entries[d]
                self.hits += 1
            else:
                missing[d] = s
        if missing:
            images = [s.image for s in missing.values()]
            pixels = torch.cat([im.pixels for im in images]).to(self.device)
            with torch.inference_mode():
                out = self.encode(pixels, [im.grid for im in images])
            for d, part in zip(missing, out.split([im.num_tokens for im in images]), strict=True):
                found[d] = part
                self._put(d, part)
            self.encoded_images += len(images)
        return found

    def clear(self) -> None:
        self.entries.clear()
        self.rows = 0

    def _put(self, digest: bytes, emb: torch.Tensor) -> None:
        self.entries[digest] = emb
        self.rows += emb.shape[0]
        while self.rows > self.capacity_rows and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.rows -= old.shape[0]

    def step_rows(self, requests: Sequence[Request], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embeddings [E, D], packed rows [E]) of a step whose requests compute `counts` tokens each from their
        num_computed_tokens, packed in this order (serve/pack.py); None when no chunk covers an image token."""
        covered = [(at, req, n) for at, req, n in _offsets(requests, counts) if req.images]
        spans = [s for _, req, n in covered for s in _overlapping(req.images, req.num_computed_tokens, n)]
        if not spans:
            return None
        emb = self.embeddings(spans)
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for at, req, n in covered:
            c = req.num_computed_tokens
            for s in _overlapping(req.images, c, n):
                lo, hi = max(c, s.start), min(c + n, s.end)
                rows.extend(range(at + lo - c, at + hi - c))
                parts.append(emb[s.image.digest][lo - s.start : hi - s.start])
        return torch.cat(parts), torch.tensor(rows, dtype=torch.int64, device=self.device)

    def check_integrity(self) -> None:
        rows = sum(e.shape[0] for e in self.entries.values())
        if rows != self.rows:
            raise AssertionError(f"EncoderCache: {self.rows} rows counted, {rows} held")
        if self.rows > self.capacity_rows and len(self.entries) > 1:
            raise AssertionError(f"EncoderCache: {self.rows} rows held past the capacity {self.capacity_rows}")


def _overlapping(spans: Sequence[ImageSpan], start: int, n: int) -> list[ImageSpan]:
    return [s for s in spans if s.start < start + n and s.end > start]


def _offsets(requests: Sequence[Request], counts: Sequence[int]) -> list[tuple[int, Request, int]]:
    out, at = [], 0
    for req, n in zip(requests, counts, strict=True):
        out.append((at, req, n))
        at += n
    return out
