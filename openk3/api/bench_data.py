"""Seeded workloads for `openk3 bench serve`: random, prefix_repetition and multi-turn conversations (vLLM's datasets).

Prompts are token ids drawn from the server's own vocabulary (a seeded word corpus passed once through `/tokenize`), so
input lengths are exact whatever the tokenizer; without `/tokenize` they fall back to text of about the right length.
A multi-turn conversation is a list of user turns; the client appends each reply before sending the next turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had not but first one their "
    "its new after who they have her she two been other when there all during into school time may years more most only over city "
    "some world would where later up such used many can state about national out known university united then made"
).split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # completions; a multi-turn conversation uses `turns` instead
    output_len: int
    turns: tuple[str, ...] = ()

    @property
    def input_len(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else len(self.prompt.split())


@dataclass(frozen=True)
class DatasetConfig:
    name: str  # random | prefix_repetition | multiturn
    num_prompts: int
    seed: int = 0
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 256
    suffix_len: int = 64
    num_prefixes: int = 4
    num_turns: int = 4
    turn_len: int = 32  # words per user turn

    def __post_init__(self) -> None:
        if self.name not in ("random", "prefix_repetition", "multiturn"):
            raise ValueError(f"dataset={self.name!r} is invalid: expected random, prefix_repetition or multiturn")
        for name in ("num_prompts", "input_len", "output_len", "prefix_len", "num_prefixes", "num_turns", "turn_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected an integer >= 1")
        if self.suffix_len < 0 or not 0 <= self.range_ratio < 1:
            raise ValueError(f"suffix_len={self.suffix_len}, range_ratio={self.range_ratio}: expected suffix_len >= 0 and 0 <= range_ratio < 1")


def word_corpus(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))


def _ids(rng: random.Random, pool: list[int] | None, n: int) -> list[int] | str:
    if pool is None:
        return word_corpus(rng, n)
    return [rng.choice(pool) for _ in range(n)]


def make_requests(cfg: DatasetConfig, pool: list[int] | None) -> list[BenchRequest]:
    """The workload; `pool` is the token ids prompts are drawn from (None: text prompts of n words)."""
    rng = random.Random(cfg.seed)
    if cfg.name == "random":
        return [
            BenchRequest(_ids(rng, pool, _length(rng, cfg.input_len, cfg.range_ratio)), _length(rng, cfg.output_len, cfg.range_ratio))
            for _ in range(cfg.num_prompts)
        ]
    if cfg.name == "prefix_repetition":
        prefixes = [_ids(rng, pool, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
        out = []
        for i in range(cfg.num_prompts):
            prefix, suffix = prefixes[i % cfg.num_prefixes], _ids(rng, pool, cfg.suffix_len)
            if isinstance(prefix, list) and isinstance(suffix, list):
                out.append(BenchRequest(prefix + suffix, cfg.output_len))
            else:
                out.append(BenchRequest(f"{prefix} {suffix}", cfg.output_len))
        rng.shuffle(out)
        return out
    num_conversations = -(-cfg.num_prompts // cfg.num_turns)
    convs = []
    for c in range(num_conversations):
        turns = min(cfg.num_turns, cfg.num_prompts - c * cfg.num_turns)
        convs.append(BenchRequest("", cfg.output_len, tuple(word_corpus(rng, cfg.turn_len) for _ in range(turns))))
    return convs


def ideal_prefix_hit_rate(cfg: DatasetConfig) -> float:
    """prefix / (prefix + suffix) x (1 - prefixes / prompts): the share of prompt tokens a perfect prefix cache serves."""
    return cfg.prefix_len / (cfg.prefix_len + cfg.suffix_len) * max(0.0, 1 - cfg.num_prefixes / cfg.num_prompts)
