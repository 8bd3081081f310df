"""KDA across context-parallel ranks by a scan (`--kda-cp scan`): every rank runs its shard's recurrence at once, none
waits for the state of the rank before it.

Legend: T_r this rank's tokens, H heads, K key dim, V value dim, W ranks; S a state [H, K, V] (the cache's layout).

Why it is exact: the delta rule is affine in its state. One token maps S to (I - beta k k^T) Diag(alpha) S + beta k v^T:
the gates and the key act on the K rows from the left, and every one of the V columns is its own linear recurrence. So
after a shard, S_end = A S_0 + B, with A [H, K, K] the product of the shard's per-token transitions and B the end state
from zeros, and every output row is affine in S_0 as well: o_t = o_t(0) + (scale q_t^T A_{<=t}) S_0. One run of the
ordinary kernel (any registered `kda_prefill`) gives all of it: widen the values with K zero columns and start from the
state [0 | I]; the extra columns carry the identity through the transitions (no value ever enters them), so the run ends
in [B | A], and its extra output columns are exactly scale q_t^T A_{<=t}. Each rank r then needs the composition of
its predecessors' maps, which an exclusive scan gives in 1 + ceil(log2(W - 1)) rounds of point-to-point messages
(Hillis-Steele: every rank hands its map to the next, then in round d rank r sends what it holds to r + 2^(d-1) and
composes what it receives from r - 2^(d-1)), so rank r receives at most one map per round, not W - 1. Rank 0 knows its
start (zeros, or the slot's state after a context) and runs the ordinary form; its map is (its end state, A = 0), so
every composition that includes it is a constant: the start state itself.

What it costs against the state handed rank to rank: the recurrence over V + K columns instead of V (about 2x the
recurrence's work where K = V: the planner's SCAN_WORK), per KDA layer up to 1 + ceil(log2(W - 1)) maps [H, K, V + K]
received (the planner's `CPBytes.kda_map` and `kda_hops_per_layer`), and the ranks no longer wait for each other's
recurrence: with W ranks the sequential form's last rank starts its recurrence after W - 1 others, the scan's after
none, and then waits only for the rounds' small messages. fp32 throughout (the kernels' state dtype); the result differs
from one process by rounding only (the order of additions changes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


def widened(v: torch.Tensor, num_key: int) -> torch.Tensor:
    """[..., H, V] -> [..., H, V + K]: the values with K zero columns, which carry the transitions."""
    return torch.cat([v, v.new_zeros((*v.shape[:-1], num_key))], dim=-1)


def identity_start(num_heads: int, num_key: int, num_value: int, like: torch.Tensor) -> torch.Tensor:
    """[1, H, K, V + K]: the start state [0 | I] of a shard whose real start is not known yet."""
    start = like.new_zeros((1, num_heads, num_key, num_value + num_key), dtype=torch.float32)
    start[..., num_value:] = torch.eye(num_key, dtype=torch.float32, device=like.device)
    return start


@dataclass(frozen=True)
class Affine:
    """A state map S -> A S + B: A [H, K, K] (None: zero, the start is known), B [H, K, V]."""

    A: torch.Tensor | None
    B: torch.Tensor

    @classmethod
    def of_widened(cls, state: torch.Tensor, num_value: int) -> Affine:
        """From a widened run's state [..., H, K, V + K] = [B | A]."""
        return cls.unpacked(state.reshape(state.shape[-3:]), num_value)

    def apply(self, start: torch.Tensor) -> torch.Tensor:
        """[H, K, V]: A start + B."""
        return self.B if self.A is None else torch.matmul(self.A, start.float()) + self.B

    def packed(self) -> torch.Tensor:
        """[H, K, V + K] = [B | A] (A = 0 when the start was known), one scan message."""
        a = self.B.new_zeros((*self.B.shape[:-1], self.B.shape[-2])) if self.A is None else self.A
        return torch.cat([self.B, a], dim=-1)

    @classmethod
    def unpacked(cls, t: torch.Tensor, num_value: int) -> Affine:
        """From [H, K, V + K] = [B | A]: a scan message (`packed`), or a widened run's end state."""
        return cls(t[..., num_value:], t[..., :num_value])

    def after(self, first: Affine) -> Affine:
        """The map `first`, then this one: S -> A (A' S + B') + B."""
        if self.A is None:
            return self
        a = None if first.A is None else torch.matmul(self.A, first.A)
        return Affine(a, torch.matmul(self.A, first.B) + self.B)


class ScanLink(Protocol):
    """The point-to-point messages of the scan (exchange.CPExchange)."""

    @property
    def rank(self) -> int: ...

    @property
    def last(self) -> int: ...

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None: ...

    def recv(self, like: torch.Tensor, src: int, layer: int, what: str, tag: int) -> torch.Tensor: ...


SCAN_TAG = 1 << 20  # the scan's messages: SCAN_TAG + layer * 64 + round, apart from the hand-offs' 2 x layer (+ 1)


def predecessors(mine: Affine, link: ScanLink, layer: int, num_value: int) -> Affine | None:
    """The composition of ranks 0 .. r - 1's maps on rank r (None on rank 0): an exclusive Hillis-Steele scan, every
    rank calling it alike. Round 0 hands each map to the next rank; then with stride s = 1, 2, 4, ... while s < W - 1,
    rank r >= 1, holding the composition of ranks [max(0, r - s), r - 1], sends it to r + s and composes what rank
    r - s >= 1 sends it (ranks [max(0, r - 2s), r - s - 1]) before its own."""
    r, last = link.rank, link.last
    payload = mine.packed()
    if r < last:
        link.send(payload, r + 1, SCAN_TAG + layer * 64)
    held = Affine.unpacked(link.recv(payload, r - 1, layer, "kda_scan", SCAN_TAG + layer * 64), num_value) if r > 0 else None
    stride, round_ = 1, 1
    while stride < last:
        tag = SCAN_TAG + layer * 64 + round_
        if held is not None and r + stride <= last:
            link.send(held.packed(), r + stride, tag)
        if r - stride >= 1:
            assert held is not None
            held = held.after(Affine.unpacked(link.recv(payload, r - stride, layer, "kda_scan", tag), num_value))
        stride, round_ = 2 * stride, round_ + 1
    return held


def start_of(rank: int, pairs: list[Affine], first_start: torch.Tensor) -> torch.Tensor:
    """[H, K, V]: the state rank `rank`'s shard starts from, its predecessors' maps folded onto `first_start` one by one
    (the definition `predecessors` computes in log-depth rounds)."""
    state = first_start.float()
    for pair in pairs[:rank]:
        state = pair.apply(state)
    return state


def corrected_output(o_widened: torch.Tensor, start: torch.Tensor, num_value: int) -> torch.Tensor:
    """[..., T, H, V]: o(0) + (scale q^T A_{<=t}) start, from a widened run's output [..., T, H, V + K]."""
    base, carried = o_widened[..., :num_value], o_widened[..., num_value:]
    return base + torch.einsum("...thk,hkv->...thv", carried.float(), start.float()).to(base.dtype)
