"""Seeded workloads for `openk3 bench serve`: random, prefix_repetition, multi-turn and ShareGPT files (vLLM's datasets), and
the arrival times of the requests.

Prompts are token ids drawn from the server's own vocabulary (a seeded word corpus passed once through `/tokenize`), so
input lengths are exact whatever the tokenizer; without `/tokenize` they fall back to text of about the right length.
A multi-turn conversation is a list of user turns; the client appends each reply before sending the next turn.
A ShareGPT file is a JSON list of {"conversations": [{"from": "human" | "gpt", "value": text}, ...]}; each conversation gives
its first human turn as the prompt (text) and the gpt reply after it; lengths are the server's `/tokenize` counts, filtered as
vLLM does (SHAREGPT_* below), in the file's order shuffled with the seed; too few that fit are repeated (seeded) up to the count.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had not but first one their "
    "its new after who they have her she two been other when there all during into school time may years more most only over city "
    "some world would where later up such used many can state about national out known university united then made"
).split()


DATASETS = ("random", "prefix_repetition", "multiturn", "sharegpt")
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's is_valid_sequence bounds, in tokens
HUMAN, GPT = ("human", "user"), ("gpt", "chatgpt", "assistant")  # the "from" of a prompt / reply turn


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # completions; a multi-turn conversation uses `turns` instead
    output_len: int
    turns: tuple[str, ...] = ()
    prompt_len: int | None = None  # tokens, where measured (ShareGPT)

    @property
    def input_len(self) -> int:
        if self.prompt_len is not None:
            return self.prompt_len
        return len(self.prompt) if isinstance(self.prompt, list) else len(self.prompt.split())


@dataclass(frozen=True)
class DatasetConfig:
    name: str  # one of DATASETS
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
    dataset_path: str | None = None  # sharegpt: the JSON file
    sharegpt_output_len: int | None = None  # sharegpt: every output this long (None: the gpt reply's length)

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset={self.name!r} is invalid: expected one of {', '.join(DATASETS)}")
        if self.name == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"sharegpt_output_len={self.sharegpt_output_len} is invalid: expected an integer >= 1")
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
    """The workload; `pool` is the token ids prompts are drawn from (None: text prompts of n words). Not for sharegpt."""
    if cfg.name == "sharegpt":
        raise ValueError("sharegpt prompts come from sharegpt_requests, which measures them with the server's tokenizer")
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


def arrival_intervals(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive sends (num - 1 of them): gamma with shape `burstiness` and mean 1 / rate, as vLLM.
    Burstiness 1 is a Poisson process; below 1 the arrivals bunch, above 1 they even out. rate inf: all at once."""
    if not (rate > 0 and 0 < burstiness < math.inf):
        raise ValueError(f"--request-rate {rate} --burstiness {burstiness}: expected a rate > 0 (inf: all at once) and a finite burstiness > 0")
    if math.isinf(rate):
        return [0.0] * max(0, num - 1)
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num - 1)]


def sharegpt_fits(prompt_len: int, output_len: int, fixed_output_len: bool) -> bool:
    """vLLM's is_valid_sequence: prompt and reply at least 4 tokens (the reply unchecked when the output length is fixed),
    prompt at most 1024, both together at most 2048."""
    if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output_len and output_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


def _first_exchange(turns: object) -> tuple[str, str] | None:
    if not isinstance(turns, list):
        return None
    human = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") in HUMAN), None)
    if human is None or human + 1 >= len(turns):
        return None
    ask, reply = turns[human], turns[human + 1]
    if not isinstance(reply, dict) or reply.get("from") not in GPT:
        return None
    if not isinstance(ask.get("value"), str) or not isinstance(reply.get("value"), str):
        return None
    return ask["value"], reply["value"]


def load_sharegpt(path: str, seed: int) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply to it) of each conversation that has both, shuffled with the seed."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--dataset-path {path!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset-path {path!r} is not a JSON file: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f'--dataset-path {path!r}: expected a JSON list of {{"conversations": [...]}} entries (ShareGPT format)')
    pairs = [p for p in (_first_exchange(e.get("conversations")) for e in data if isinstance(e, dict)) if p is not None]
    if not pairs:
        raise ValueError(f"--dataset-path {path!r}: no conversation has a human turn followed by a gpt reply")
    random.Random(seed).shuffle(pairs)
    return pairs


async def sharegpt_requests(cfg: DatasetConfig, count_tokens: Callable[[list[str], bool], Awaitable[list[int]]], batch: int = 64) -> list[BenchRequest]:
    """cfg.num_prompts requests from the ShareGPT file; count_tokens(texts, add_special_tokens) is the server's tokenizer."""
    assert cfg.dataset_path is not None
    pairs, fixed = load_sharegpt(cfg.dataset_path, cfg.seed), cfg.sharegpt_output_len
    out: list[BenchRequest] = []
    for at in range(0, len(pairs), batch):
        chunk = pairs[at : at + batch]
        prompt_lens = await count_tokens([p for p, _ in chunk], True)
        reply_lens = [fixed] * len(chunk) if fixed is not None else await count_tokens([r for _, r in chunk], False)
        for (prompt, _), p_len, o_len in zip(chunk, prompt_lens, reply_lens, strict=True):
            if sharegpt_fits(p_len, o_len, fixed is not None):
                out.append(BenchRequest(prompt, o_len, prompt_len=p_len))
            if len(out) == cfg.num_prompts:
                return out
    if not out:
        raise ValueError(
            f"--dataset-path {cfg.dataset_path!r}: no conversation fits (prompts of {SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} "
            f"tokens, replies of at least {SHAREGPT_MIN_LEN} unless --sharegpt-output-len, at most {SHAREGPT_MAX_TOTAL_LEN} together)"
        )
    return out + random.Random(cfg.seed).choices(out, k=cfg.num_prompts - len(out))
