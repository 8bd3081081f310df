"""Many teachers for one student: which teacher scores which tokens, that they all share the student's tokenizer, and the
scoring itself through openk3's engine (prompt logprobs, computed in the prefill forward).

Legend: W windows, L scored positions per window (a window is L + 1 tokens), k stored alternatives per position.

Routing: each window names its domain; `TeacherRouting.domains` maps a domain to its teacher, and an optional reasoning
teacher scores the positions whose target token lies inside a thinking segment, as the chat format marks it: after the open
marker, up to and including the close marker (the reasoning teacher also decides when thinking ends). A segment still open
at the window's end runs to the end; a window that starts inside a segment (its open marker cut off) is not thinking.
Markers are matched as token-id sequences, so `<|open|>think<|sep|>` (K3) and `<think>` (K2) work alike; their strings are
those of api/chat_format.py.

Tokenizers: teachers may differ in size and in model vocabulary (padding rows past the tokenizer's ids), never in the
tokenizer: every id must mean the same token. `check_same_tokenizer` compares the id -> token tables (not the names or
paths) and names the first id that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.train.teacher_store import ScoredWindows

K2_THINK = ("<think>", "</think>")
K3_THINK = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")


class TokenizerMismatch(ValueError):
    """Two models that must share a tokenizer do not: the message names both and the first id that differs."""


def vocab_table(tokenizer: Any) -> dict[int, str]:
    """id -> token: the vocabulary with added tokens where the tokenizer lists it (tokenizers / HFTokenizer), else each id
    decoded alone with special tokens kept (the byte tokenizer)."""
    if hasattr(tokenizer, "get_vocab"):
        return {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    return {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    table = vocab_table(tokenizer)
    return hashlib.sha256(json.dumps(sorted(table.items())).encode()).hexdigest()[:16]


def check_same_tokenizer(tokenizers: Mapping[str, Any]) -> str:
    """The shared fingerprint; a TokenizerMismatch naming the first pair and id that differ otherwise."""
    names = list(tokenizers)
    if not names:
        raise ValueError("check_same_tokenizer: no tokenizers given")
    first = vocab_table(tokenizers[names[0]])
    for name in names[1:]:
        other = vocab_table(tokenizers[name])
        if other == first:
            continue
        ids = sorted(set(first) | set(other))
        bad = next(i for i in ids if first.get(i) != other.get(i))
        raise TokenizerMismatch(
            f"{names[0]!r} and {name!r} do not share a tokenizer: {len(first)} vs {len(other)} ids, and id {bad} is "
            f"{first.get(bad)!r} in {names[0]!r} but {other.get(bad)!r} in {name!r}; distillation needs the same id -> token table"
        )
    return tokenizer_fingerprint(tokenizers[names[0]])


@dataclass(frozen=True)
class ThinkingMarkers:
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]

    @classmethod
    def encode(cls, tokenizer: Any, markers: tuple[str, str] = K2_THINK) -> ThinkingMarkers:
        open_ids, close_ids = (tuple(tokenizer.encode(m)) for m in markers)
        if not open_ids or not close_ids:
            raise ValueError(f"thinking markers {markers} encode to no tokens")
        return cls(open_ids, close_ids)


def _ends_with(ids: Sequence[int], t: int, marker: tuple[int, ...]) -> bool:
    """Whether the marker ends at position t."""
    n = len(marker)
    return t + 1 >= n and tuple(ids[t + 1 - n : t + 1]) == marker


def thinking_mask(tokens_WL1: torch.Tensor, markers: ThinkingMarkers) -> torch.Tensor:
    """[W, L] bool: whether the target token of each position (tokens[:, 1:]) lies inside a thinking segment."""
    W, L1 = tokens_WL1.shape
    mask = torch.zeros(W, L1, dtype=torch.bool)
    for w, ids in enumerate(tokens_WL1.tolist()):
        inside = False
        for t in range(L1):
            if inside:
                mask[w, t] = True
                if _ends_with(ids, t, markers.close_ids):
                    inside = False
            elif _ends_with(ids, t, markers.open_ids):
                inside = True
    return mask[:, 1:]


@dataclass(frozen=True)
class TeacherRouting:
    """domain -> teacher name, and the optional reasoning teacher of the thinking segments."""

    domains: Mapping[str, str]
    reasoning: str | None = None
    markers: ThinkingMarkers | None = field(default=None)

    def __post_init__(self) -> None:
        if not self.domains:
            raise ValueError("TeacherRouting.domains is empty: map at least one domain to a teacher")
        if (self.reasoning is None) != (self.markers is None):
            raise ValueError("TeacherRouting: a reasoning teacher needs the thinking markers, and markers need a reasoning teacher")

    def teachers(self) -> tuple[str, ...]:
        names = list(dict.fromkeys(self.domains.values()))
        return tuple(names + ([self.reasoning] if self.reasoning and self.reasoning not in names else []))

    def teacher_of(self, domain: str) -> str:
        if domain not in self.domains:
            raise ValueError(f"domain {domain!r} has no teacher: the routing table maps {sorted(self.domains)}")
        return self.domains[domain]

    def check_teachers(self, available: Sequence[str]) -> None:
        missing = [t for t in self.teachers() if t not in available]
        if missing:
            raise ValueError(f"the routing table names teachers {missing} that were not given (given: {sorted(available)})")


def serving_engine(model: torch.nn.Module, tokenizer: Any, **options: Any) -> Any:
    """An LLM over a fresh copy of a trainer's model (its own modules and ops, in eval mode), so the trainer keeps its own."""
    from openk3.llm import LLM
    from openk3.model import K3ForCausalLM

    copy = K3ForCausalLM(model.config)  # type: ignore[arg-type]
    copy.load_state_dict(model.state_dict())
    return LLM(copy.eval(), tokenizer, **options)


def score_with_engine(llm: Any, windows_WL1: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and logprobs [W, L, k] after each prefix of each window, from the engine's prompt logprobs
    (one prefill per window, one token sampled and thrown away)."""
    from openk3.serve.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, ignore_eos=True)
    W, L1 = windows_WL1.shape
    ids = torch.empty(W, L1 - 1, k, dtype=torch.int64)
    lps = torch.empty(W, L1 - 1, k, dtype=torch.float32)
    for w, out in enumerate(llm.generate([row.tolist() for row in windows_WL1], params)):
        scored = [s for s in out.prompt_logprobs or () if s is not None]
        if len(scored) != L1 - 1 or any(len(s.top) != k for s in scored):
            raise AssertionError(f"the engine scored {len(scored)} positions of a {L1}-token window, expected {L1 - 1} with {k} alternatives")
        ids[w] = torch.tensor([[i for i, _ in s.top] for s in scored])
        lps[w] = torch.tensor([[v for _, v in s.top] for s in scored])
    return ids, lps


def score_routed(
    engines: Mapping[str, Any], routing: TeacherRouting, windows_WL1: torch.Tensor, domains: Sequence[str], k: int, all_domains: Sequence[str]
) -> ScoredWindows:
    """Each window scored by its domain's teacher, and its thinking positions by the reasoning teacher (module docstring)."""
    routing.check_teachers(list(engines))
    W, L1 = windows_WL1.shape
    if len(domains) != W:
        raise ValueError(f"score_routed: {len(domains)} domains for {W} windows")
    names = routing.teachers()
    ids = torch.empty(W, L1 - 1, k, dtype=torch.int64)
    lps = torch.empty(W, L1 - 1, k, dtype=torch.float32)
    teacher = torch.empty(W, L1 - 1, dtype=torch.int64)
    for name in dict.fromkeys(routing.teacher_of(d) for d in domains):
        rows = torch.tensor([w for w, d in enumerate(domains) if routing.teacher_of(d) == name])
        ids[rows], lps[rows] = score_with_engine(engines[name], windows_WL1[rows], k)
        teacher[rows] = names.index(name)
    if routing.reasoning is not None and routing.markers is not None:
        think = thinking_mask(windows_WL1, routing.markers)
        rows = think.any(-1).nonzero()[:, 0]
        if rows.numel():
            r_ids, r_lps = score_with_engine(engines[routing.reasoning], windows_WL1[rows], k)
            sel = think[rows]
            ids[rows] = torch.where(sel[..., None], r_ids, ids[rows])
            lps[rows] = torch.where(sel[..., None], r_lps, lps[rows])
            teacher[rows] = torch.where(sel, names.index(routing.reasoning), teacher[rows])
    domain_W = torch.tensor([list(all_domains).index(d) for d in domains], dtype=torch.int64)
    return ScoredWindows(windows_WL1, ids, lps, domain_W, teacher)
