"""Per-request grammar state for the sampler: one token bitmask for a step's constrained rows, applied in one call.

Each request with a `Grammar` (SamplingParams.structured_outputs) has a matcher whose state is a function of the grammar,
its stop tokens and its output tokens alone, so a state is a cache, never the truth: it is kept by the row's request id with
the number of output tokens it has read, and rebuilt from the output tokens whenever that does not match (a new request,
one resumed after preemption). Two requests are never confused, whatever their tokens. A row that names no request (a
caller that does not pass ids) is kept by the identity of its token list instead, which the state holds so that the id
cannot be reused while it lives. States of requests that did not sample this step are dropped, so memory follows the batch.
Per step: `mask` fills one [M, ceil(V/32)] int32 bitmask for the constrained rows (xgrammar's batch fill, in C++) and
sets the disallowed logits to -inf in one call; after sampling, `advance` feeds each row its token (one batch call).
A request's stop tokens are allowed exactly when its grammar accepts (xgrammar's per-matcher stop tokens); a row with
no stop token at all runs unconstrained once its grammar has ended, rather than with every token masked.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.spec import Grammar


class SamplingRow(Protocol):
    """What a row of the sampler (serve/sampler.py) offers here."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def request_id(self) -> str | None: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def stop_token_ids(self) -> frozenset[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class _State:
    token_ids: Sequence[int]  # the row's token list: held, so that its id cannot be reused while the state lives
    matcher: Any  # xgrammar.GrammarMatcher
    num_read: int  # output tokens the matcher has accepted (or stopped on)


def _grammar(row: SamplingRow) -> Grammar | None:
    return row.params.structured_outputs


def _key(row: SamplingRow) -> Hashable:
    return ("request", row.request_id) if row.request_id is not None else ("token list", id(row.token_ids))


class GrammarStates:
    def __init__(self, max_threads: int = 1) -> None:
        # one thread: a fill costs tens of microseconds per row at these vocabularies, and xgrammar's pool competes with
        # the model's own threads for the cores (measured slower with 2 on 2 cores: benchmarks/results/structured_output.md)
        self._states: dict[Hashable, _State] = {}
        self._max_threads = max_threads
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use

    def __len__(self) -> int:
        return len(self._states)

    def _new_state(self, row: SamplingRow, grammar: Grammar, vocab: int) -> _State:
        import xgrammar as xgr

        stops = sorted(t for t in row.stop_token_ids if t < vocab)
        matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=stops or None, terminate_without_stop_token=not stops)
        out = row.output_token_ids
        for k, token in enumerate(out):
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                raise RuntimeError(f"structured output: output token {k} ({token}) does not match the request's grammar")
        return _State(row.token_ids, matcher, len(out))

    def _state(self, row: SamplingRow, grammar: Grammar, vocab: int) -> _State:
        st = self._states.get(_key(row))
        stale = st is None or st.num_read != row.num_output_tokens or (row.request_id is None and st.token_ids is not row.token_ids)
        return self._new_state(row, grammar, vocab) if stale or st is None else st

    def mask(self, logits_MV: torch.Tensor, rows: Sequence[SamplingRow]) -> list[tuple[int, _State]]:
        """Mask (in place) the logits of every row with a grammar; returns (row, state) for `advance`."""
        vocab = logits_MV.shape[1]
        picked: list[tuple[int, _State]] = []
        states: dict[Hashable, _State] = {}
        for i, row in enumerate(rows):
            grammar = _grammar(row)
            if grammar is None:
                continue
            if grammar.vocab_size != vocab:
                raise ValueError(f"structured output: grammar compiled for {grammar.vocab_size} ids, logits have {vocab}")
            key = _key(row)
            if key in states:
                raise ValueError(f"structured output: rows {picked[-1][0] if picked else i} and {i} of one step are the same request ({key})")
            states[key] = self._state(row, grammar, vocab)
            picked.append((i, states[key]))
        self._states = states
        live = [(i, st) for i, st in picked if not st.matcher.is_terminated()]
        if not live:
            return picked
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=self._max_threads)
        index = [i for i, _ in live]
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
        self._batch.batch_fill_next_token_bitmask([st.matcher for _, st in live], bitmask, indices=index)
        xgr.apply_token_bitmask_inplace(logits_MV, bitmask.to(logits_MV.device, non_blocking=True), vocab_size=vocab, indices=index)
        return picked

    def advance(self, picked: list[tuple[int, _State]], tokens: Sequence[int]) -> None:
        """Feed each constrained row the token it sampled."""
        live = [(i, st) for i, st in picked if not st.matcher.is_terminated()]
        for _, st in picked:
            st.num_read += 1
        if not live:
            return
        accepted = self._batch.batch_accept_token([st.matcher for _, st in live], [tokens[i] for i, _ in live])
        bad = next((i for (i, _), ok in zip(live, accepted, strict=True) if not ok), None)
        if bad is not None:
            raise RuntimeError(f"structured output: sampled token {tokens[bad]} (row {bad}) is outside the grammar's mask")
