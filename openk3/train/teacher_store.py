"""The teachers' top-k logprobs on a corpus, written once and streamed by the off-policy trainer: a folder of safetensors shards.

Legend: W windows in a shard, L scored positions per window, k stored alternatives per position.

Each shard `shard-NNNNN.safetensors` holds
  tokens        int32 [W, L + 1]  the window (inputs tokens[:, :-1], targets tokens[:, 1:])
  topk_ids      int32 [W, L, k]   the teacher's k most likely next tokens after tokens[:, :t + 1], most likely first
  topk_logprobs fp32  [W, L, k]   their logprobs under the teacher's full distribution (so the tail is 1 - their sum)
  domain        int32 [W]         index into the store's domains
  teacher       int32 [W, L]      index into the store's teachers: who scored each position (a reasoning teacher scores
                                  the thinking segments, the domain's teacher the rest)
and `store.json` the layout: k, L, the tokenizer's fingerprint (train/teachers.py), the domain and teacher names, the
shard files and their window counts. A shard holds about 1.3 MB per 1000 positions at k = 16 (k * 8 + 8 bytes per position).

Streaming: `TeacherStream` keeps one shard in memory, visits the shards in a seeded order per epoch and the windows of a
shard in a seeded order, and its position (epoch, shard, row) is all a resumed run needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

STORE_FILE = "store.json"
FORMAT = "openk3-teacher-topk-v1"
TENSORS = ("tokens", "topk_ids", "topk_logprobs", "domain", "teacher")  # the shard's names, in ScoredWindows order


class ScoredWindows(NamedTuple):
    tokens_WL1: torch.Tensor
    topk_ids_WLk: torch.Tensor
    topk_logprobs_WLk: torch.Tensor
    domain_W: torch.Tensor
    teacher_WL: torch.Tensor


@dataclass(frozen=True)
class StoreLayout:
    k: int
    seq_len: int
    tokenizer: str  # fingerprint of the vocabulary every teacher and the student share
    domains: tuple[str, ...]
    teachers: tuple[str, ...]
    shards: tuple[tuple[str, int], ...] = ()  # (file name, windows)

    @property
    def num_windows(self) -> int:
        return sum(n for _, n in self.shards)


def read_layout(path: str | Path) -> StoreLayout:
    file = Path(path) / STORE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: not a teacher store (write one with `openk3 distill score`)")
    raw = json.loads(file.read_text())
    if raw.get("format") != FORMAT:
        raise ValueError(f"{file}: format {raw.get('format')!r}, expected {FORMAT!r}")
    return StoreLayout(
        int(raw["k"]), int(raw["seq_len"]), raw["tokenizer"], tuple(raw["domains"]), tuple(raw["teachers"]), tuple((f, int(n)) for f, n in raw["shards"])
    )


class StoreWriter:
    """Appends scored windows as shards of `shard_windows` windows; `close()` writes the last shard and store.json."""

    def __init__(self, path: str | Path, layout: StoreLayout, shard_windows: int = 512) -> None:
        if shard_windows < 1:
            raise ValueError(f"shard_windows={shard_windows} is invalid: expected >= 1")
        self.path, self.layout, self.shard_windows = Path(path), layout, shard_windows
        self.path.mkdir(parents=True, exist_ok=True)
        if (self.path / STORE_FILE).exists():
            raise FileExistsError(f"{self.path / STORE_FILE} exists: write a new store into an empty folder")
        self.pending: list[ScoredWindows] = []
        self.shards: list[tuple[str, int]] = []

    def add(self, batch: ScoredWindows) -> None:
        W, L1 = batch.tokens_WL1.shape
        k = self.layout.k
        if L1 != self.layout.seq_len + 1 or batch.topk_ids_WLk.shape != (W, L1 - 1, k) or batch.topk_logprobs_WLk.shape != (W, L1 - 1, k):
            raise ValueError(
                f"StoreWriter.add: tokens {tuple(batch.tokens_WL1.shape)}, topk {tuple(batch.topk_ids_WLk.shape)}; "
                f"the store holds windows of {self.layout.seq_len + 1} tokens with k={k}"
            )
        self.pending.append(batch)
        while sum(b.tokens_WL1.shape[0] for b in self.pending) >= self.shard_windows:
            self._flush(self.shard_windows)

    def _flush(self, limit: int) -> None:
        from safetensors.torch import save_file

        parts = [torch.cat(x) for x in zip(*self.pending, strict=True)]
        now, rest = [p[:limit] for p in parts], [p[limit:] for p in parts]
        self.pending = [ScoredWindows(*rest)] if rest[0].shape[0] else []
        name = f"shard-{len(self.shards):05d}.safetensors"
        tensors = {n: t.to(torch.float32 if n == "topk_logprobs" else torch.int32).contiguous() for n, t in zip(TENSORS, now, strict=True)}
        save_file(tensors, str(self.path / name))
        self.shards.append((name, int(now[0].shape[0])))

    def close(self) -> StoreLayout:
        if self.pending:
            self._flush(sum(b.tokens_WL1.shape[0] for b in self.pending))
        lay = self.layout
        doc = {"format": FORMAT, "k": lay.k, "seq_len": lay.seq_len, "tokenizer": lay.tokenizer, "domains": list(lay.domains)}
        doc |= {"teachers": list(lay.teachers), "shards": self.shards}
        (self.path / STORE_FILE).write_text(json.dumps(doc, indent=1) + "\n")
        return read_layout(self.path)


def load_shard(path: str | Path, name: str) -> ScoredWindows:
    from safetensors.torch import load_file

    t = load_file(str(Path(path) / name))
    return ScoredWindows(*(t[n] if n == "topk_logprobs" else t[n].long() for n in TENSORS))


class TeacherStream:
    """Batches of scored windows in a seeded order, one shard in memory at a time (module docstring)."""

    def __init__(self, path: str | Path, seed: int) -> None:
        self.path, self.seed = Path(path), seed
        self.layout = read_layout(path)
        if not self.layout.shards:
            raise ValueError(f"{self.path}: the store has no windows")
        self.epoch, self.shard, self.row = 0, 0, 0
        self._loaded: tuple[tuple[int, int], ScoredWindows, torch.Tensor] | None = None

    def _order(self, n: int, salt: int) -> torch.Tensor:
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + salt))

    def _current(self) -> tuple[ScoredWindows, torch.Tensor]:
        key = (self.epoch, self.shard)
        if self._loaded is None or self._loaded[0] != key:
            shard_index = int(self._order(len(self.layout.shards), self.epoch)[self.shard])
            name, n = self.layout.shards[shard_index]
            self._loaded = (key, load_shard(self.path, name), self._order(n, self.epoch * 7919 + shard_index + 1))
        return self._loaded[1], self._loaded[2]

    def next_batch(self, batch_size: int) -> ScoredWindows:
        rows: list[ScoredWindows] = []
        for _ in range(batch_size):
            data, order = self._current()
            i = int(order[self.row])
            rows.append(ScoredWindows(*(x[i : i + 1] for x in data)))
            self.row += 1
            if self.row == len(order):
                self.row, self.shard = 0, self.shard + 1
                if self.shard == len(self.layout.shards):
                    self.shard, self.epoch = 0, self.epoch + 1
        return ScoredWindows(*(torch.cat(x) for x in zip(*rows, strict=True)))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "row": self.row, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"stream state for seed={state['seed']}, this stream has seed={self.seed}")
        self.epoch, self.shard, self.row = int(state["epoch"]), int(state["shard"]), int(state["row"])
