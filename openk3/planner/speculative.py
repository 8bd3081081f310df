"""Speculative decoding in the step model (issue 37 item 4): k draft tokens, an acceptance-length distribution, the
draft's cost, the verify step's batch and the KDA state verification needs.

One iteration per sequence: the draft proposes k tokens one after another (k draft forwards at the decode batch, each
costing `draft_layers` of the target's layers -- MTP: one layer; a separate draft model: its cost in target-layer
equivalents), then the target verifies all k + 1 positions in one step. That verify step runs (k + 1) x the decode
batch through every GEMM, expert and attention FLOP, but reads each sequence's cache once. It emits 1 + (accepted
drafts) tokens; `acceptance[j]` is the probability that exactly j drafts are accepted (j = 0..k).

KDA: a recurrent state cannot be trimmed like MLA pages, so verification keeps the state after each verified position
(openk3's serve/spec_states.py: the verify step runs the recurrence position by position and writes the state after each
of the first k positions to a verify slot; a rejection copies the kept position's state into the sequence's slot): per
iteration k extra state writes, and with probability P(some draft rejected) one state copy (read + write); no token is
recomputed. The k per-position states are k more states per sequence in HBM (`snapshot_bytes`), which the memory model
counts (`state_copies` = k + 1) when it sizes the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.checks import fail


@dataclass(frozen=True)
class SpecDecoding:
    tokens: int  # k: draft tokens proposed per iteration
    acceptance: tuple[float, ...]  # P(exactly j drafts accepted), j = 0..k
    draft_layers: float = 1.0  # cost of one draft token in target layers (MTP module: 1)

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or self.tokens < 1:
            fail("SpecDecoding", "tokens", self.tokens, "an integer >= 1 (draft tokens per step)")
        if len(self.acceptance) != self.tokens + 1:
            fail("SpecDecoding", "acceptance", self.acceptance, f"{self.tokens + 1} probabilities (0..{self.tokens} accepted drafts)")
        if any(not 0 <= p <= 1 for p in self.acceptance) or abs(sum(self.acceptance) - 1) > 1e-6:
            fail("SpecDecoding", "acceptance", self.acceptance, "probabilities in [0, 1] summing to 1")
        if not self.draft_layers >= 0:
            fail("SpecDecoding", "draft_layers", self.draft_layers, "target-layer equivalents >= 0")

    @classmethod
    def geometric(cls, tokens: int, rate: float, draft_layers: float = 1.0) -> SpecDecoding:
        """Each draft is accepted with probability `rate` given the ones before it were: P(j) = rate^j (1 - rate), and
        P(k) = rate^k."""
        if not 0 <= rate <= 1:
            fail("SpecDecoding", "rate", rate, "a per-draft acceptance probability in [0, 1]")
        probs = [rate**j * (1 - rate) for j in range(tokens)] + [rate**tokens]
        return cls(tokens, tuple(probs), draft_layers)

    @classmethod
    def parse(cls, tokens: int, text: str, draft_layers: float = 1.0) -> SpecDecoding:
        """`--spec-acceptance`: one number (a per-draft acceptance rate) or k + 1 comma-separated probabilities."""
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            raise ValueError(f"--spec-acceptance {text!r}: expected a rate such as 0.8 or {tokens + 1} probabilities such as 0.2,0.3,0.5") from None
        if len(values) == 1:
            return cls.geometric(tokens, values[0], draft_layers)
        return cls(tokens, tuple(values), draft_layers)

    @property
    def mean_accepted(self) -> float:
        return sum(j * p for j, p in enumerate(self.acceptance))

    @property
    def tokens_per_iteration(self) -> float:
        return 1 + self.mean_accepted

    @property
    def p_reject(self) -> float:
        """Probability that at least one draft is rejected (the kept position's KDA state is copied into the sequence's slot)."""
        return 1 - self.acceptance[-1]

    @property
    def state_copies(self) -> int:
        """KDA states per sequence: its own and the k per-position states of the verification."""
        return 1 + self.tokens

    def describe(self) -> str:
        dist = ", ".join(f"{p:.2f}" for p in self.acceptance)
        return (
            f"speculative decoding: {self.tokens} draft tokens at {self.draft_layers:g} target layer(s) each; "
            f"P(0..{self.tokens} accepted) = {dist}; {self.tokens_per_iteration:.2f} tokens per verify step"
        )


@dataclass(frozen=True)
class SpecStep:
    """One speculative iteration of the busiest rank."""

    verify_s: float  # the target's step over k + 1 positions per sequence (with the per-position KDA states and the copy)
    draft_s: float  # k draft forwards
    tokens_per_iteration: float
    snapshot_bytes: float  # HBM for the k per-position KDA states per sequence on a rank

    @property
    def total_s(self) -> float:
        return self.verify_s + self.draft_s

    @property
    def per_token_s(self) -> float:
        return self.total_s / self.tokens_per_iteration
