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
Speculative decoding (serve/spec_logits.py): `draft_masks` walks a request's matcher over its draft tokens, filling the
mask of each verified position (the state after the pending token and the drafts before it) and stopping at the first
draft the grammar rejects, then rolls the matcher back to where it was; `accept_run` feeds it the tokens the
verification kept, so it ends where a plain decode of them leaves it. Rows that verify in a step are passed to `mask` as
`keep`, so their states outlive the step's sampling.
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


def _allows(bitmask_W: torch.Tensor, token: int) -> bool:
    """Whether one row of an xgrammar bitmask (bit t of word t // 32) allows `token`."""
    return token < 32 * len(bitmask_W) and bool((int(bitmask_W[token // 32]) >> (token % 32)) & 1)


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

    def mask(self, logits_MV: torch.Tensor, rows: Sequence[SamplingRow], keep: Sequence[SamplingRow] = ()) -> list[tuple[int, _State]]:
        """Mask (in place) the logits of every row with a grammar; returns (row, state) for `advance`. The states of
        `keep` (rows that verify drafts this step) are kept too; every other request's state is dropped."""
        vocab = logits_MV.shape[1]
        picked: list[tuple[int, _State]] = []
        held = {_key(r) for r in keep}
        states: dict[Hashable, _State] = {key: st for key, st in self._states.items() if key in held}
        seen: set[Hashable] = set()
        for i, row in enumerate(rows):
            grammar = _grammar(row)
            if grammar is None:
                continue
            if grammar.vocab_size != vocab:
                raise ValueError(f"structured output: grammar compiled for {grammar.vocab_size} ids, logits have {vocab}")
            key = _key(row)
            if key in seen:
                raise ValueError(f"structured output: rows {picked[-1][0] if picked else i} and {i} of one step are the same request ({key})")
            seen.add(key)
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

    def _held(self, row: SamplingRow, grammar: Grammar, vocab: int) -> _State:
        """The row's state, made (or rebuilt) where stale and kept."""
        if grammar.vocab_size != vocab:
            raise ValueError(f"structured output: grammar compiled for {grammar.vocab_size} ids, logits have {vocab}")
        st = self._states[_key(row)] = self._state(row, grammar, vocab)
        return st

    def matcher(self, row: SamplingRow, vocab: int) -> Any:
        """The row's xgrammar GrammarMatcher, current with its output (made or rebuilt where stale, and kept); a caller
        that feeds it tokens rolls them back (serve/draft_steering.py)."""
        grammar = _grammar(row)
        assert grammar is not None
        return self._held(row, grammar, vocab).matcher

    def draft_masks(self, row: SamplingRow, drafts: Sequence[int], vocab: int) -> tuple[torch.Tensor, int]:
        """For a row with a grammar whose output ends with its pending token: the [len(drafts) + 1, ceil(V/32)] bitmask of
        the verified positions (position i: the state after drafts[:i]; all ones where the grammar has ended, as `mask`
        leaves such a row unconstrained) and how many drafts the grammar accepts in a row; positions after the first
        rejected draft keep all ones (never read: the run is cut there). The matcher is rolled back to where it was."""
        import xgrammar as xgr

        grammar = _grammar(row)
        assert grammar is not None
        matcher = self._held(row, grammar, vocab).matcher
        bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, vocab)
        fed, ok = 0, 0
        for i in range(len(drafts) + 1):
            if matcher.is_terminated():
                ok = i  # as in plain decoding, nothing more is fed or masked
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
            # the mask is read first: a token outside it is not offered to the matcher (xgrammar logs each special token
            # it rejects)
            if i == len(drafts) or not _allows(bitmask[i], drafts[i]) or not matcher.accept_token(drafts[i]):
                break
            fed += 1
            ok = i + 1
        if fed:
            matcher.rollback(fed)
        return bitmask, min(ok, len(drafts))

    def accept_run(self, row: SamplingRow, tokens: Sequence[int], vocab: int) -> None:
        """Feed a row's matcher the tokens its verification kept, as `advance` feeds one sampled token each step."""
        grammar = _grammar(row)
        assert grammar is not None
        st = self._held(row, grammar, vocab)
        for k, token in enumerate(tokens):
            st.num_read += 1
            if not st.matcher.is_terminated() and not st.matcher.accept_token(token):
                raise RuntimeError(f"structured output: kept token {k} ({token}) of a verification is outside the grammar's mask")

    def check_integrity(self, rows: Sequence[SamplingRow], vocab: int) -> None:
        """Each held state of these rows that is current (it has read the row's output) accepts exactly what a matcher
        rebuilt from the row's output tokens accepts: speculation's walks and rollbacks left no trace."""
        import xgrammar as xgr

        for row in rows:
            st, grammar = self._states.get(_key(row)), _grammar(row)
            if st is None or grammar is None or st.num_read != row.num_output_tokens:
                continue
            fresh = self._new_state(row, grammar, vocab).matcher
            if fresh.is_terminated() != st.matcher.is_terminated():
                ended = (st.matcher.is_terminated(), fresh.is_terminated())
                raise AssertionError(f"structured output: {_key(row)}'s matcher terminated={ended[0]}, one rebuilt from its output {ended[1]}")
            if fresh.is_terminated():
                continue
            masks = xgr.allocate_token_bitmask(2, vocab)
            st.matcher.fill_next_token_bitmask(masks, 0)
            fresh.fill_next_token_bitmask(masks, 1)
            if not torch.equal(masks[0], masks[1]):
                raise AssertionError(f"structured output: {_key(row)}'s matcher allows other tokens than one rebuilt from its output")
