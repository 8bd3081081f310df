"""Sampler: one call turns the logits of every request that samples this step into tokens (vLLM's order and meanings).

Order: token rules (serve/token_rules.py: logit_bias, allowed_token_ids, bad_words) -> structured-output grammar mask
(serve/structured/matchers.py: one bitmask for the constrained rows, applied in one call; each row's grammar advanced with
its token after the draw) -> min_tokens mask (stop tokens forbidden until min_tokens are out) -> penalties (repetition over
prompt and output, frequency and presence over output) -> greedy rows take the argmax -> temperature -> min_p -> top_k ->
top_p -> draw.
Drawing is the exponential race argmax(p / q), q ~ Exp(1): a seeded request draws q from its own generator, so its tokens do
not depend on what else is in the batch; unseeded rows share the sampler's generator. q is drawn where the logits are, by
generators on that device (the engine makes the seeded requests' generators there too): nothing of size M x V crosses
between host and device, and the step's one host read is the sampled tokens. A CUDA generator's stream differs from a
CPU generator's of the same seed, so a seed reproduces its tokens on the same kind of device (as in vLLM). Logprobs are of the model's raw
distribution (before the grammar mask, penalties and temperature), as vLLM returns them by default.
Legend: M rows (requests sampling this step), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from openk3.ops.registry import OpTarget, registry
from openk3.serve.request import TokenLogprobs
from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.matchers import GrammarStates
from openk3.serve.token_rules import apply_token_rules, has_token_rules


@dataclass(frozen=True)
class SamplingRow:
    """One row to sample: its request's whole token list is passed as it is (no per-step copy); only the penalties, when
    asked for, look at its prompt and output parts. `request_id` keys the request's grammar state across steps
    (serve/structured/matchers.py); a row without one is kept by its token list's identity."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: Sequence[int]  # prompt then output
    num_prompt_tokens: int
    stop_token_ids: frozenset[int]
    request_id: str | None = None

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[M, V] occurrence counts; ragged lists padded with an extra column that is dropped."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.int64)
    for i, toks in enumerate(token_lists):
        if toks:
            ids[i, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def apply_penalties(logits_MV: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    vocab, device = logits_MV.shape[1], logits_MV.device
    out_counts = _counts([r.output_token_ids for r in rows], vocab, device)
    prompt_seen = _counts([r.prompt_token_ids for r in rows], vocab, device) > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=torch.float32, device=device)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=torch.float32, device=device)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=torch.float32, device=device)[:, None]
    seen = prompt_seen | (out_counts > 0)
    penalised = torch.where(logits_MV > 0, logits_MV / rep, logits_MV * rep)
    logits_MV = torch.where(seen, penalised, logits_MV)
    return logits_MV - freq * out_counts - pres * (out_counts > 0).float()


def _top_k_top_p_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop mask over logits sorted descending: ranks >= top_k, then tokens whose better tokens already hold top_p of the mass."""
    neg_inf = torch.finfo(sorted_logits.dtype).min
    rank = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)[None, :]
    drop = rank >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, neg_inf).softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # probability of the strictly better tokens
    drop = drop | (mass_before >= top_p[:, None])
    drop[:, 0] = False
    return drop


def apply_top_k_top_p_min_p(logits_MV: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to the dtype's min) the tokens outside min_p, then top_k [M] (V keeps all), then top_p [M]; one token always survives."""
    neg_inf = torch.finfo(logits_MV.dtype).min
    vocab = logits_MV.shape[1]
    if bool((min_p > 0).any()):
        probs = logits_MV.softmax(-1)
        keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
        logits_MV = logits_MV.masked_fill(~keep, neg_inf)
    if bool((top_k >= vocab).all()) and bool((top_p >= 1).all()):
        return logits_MV
    if bool((top_k < vocab).all()):
        # every row has a top_k: top-p only ever looks inside it, so a partial top-k replaces the full sort
        k_max = int(top_k.max())
        top_vals, top_idx = logits_MV.topk(k_max, dim=-1)
        drop = _top_k_top_p_sorted(top_vals, top_k, top_p)
        kept = torch.full_like(logits_MV, neg_inf)
        return kept.scatter(1, top_idx, top_vals.masked_fill(drop, neg_inf))
    sorted_logits, order = logits_MV.sort(-1, descending=True)
    drop = _top_k_top_p_sorted(sorted_logits, top_k, top_p)
    return logits_MV.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), neg_inf)


def token_logprobs(logprobs_V: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """A sampled token's logprob and the `num_top` most likely tokens' from one position's log-softmax."""
    top = logprobs_V.topk(num_top) if num_top else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
    return TokenLogprobs(token_id=token, logprob=float(logprobs_V[token]), top=pairs)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without their own seed, on the logits' device
        self.grammars = GrammarStates()  # per-request grammar matchers, kept by the rows' request ids
        # the greedy rows' argmax (ops/argmax_c.py: torch.argmax's tie and NaN rules on every form); the logits are fp32
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = registry().get("argmax_rows", "auto", OpTarget(torch.device(device).type))

    def __call__(self, logits_MV: torch.Tensor, rows: Sequence[SamplingRow], verifying: Sequence[SamplingRow] = ()) -> SamplerOutput:
        """Tokens (and asked-for logprobs) for `rows`; `verifying`: the rows that verify drafts in the same step
        (serve/spec_logits.py), whose grammar states are kept for that."""
        m, vocab = logits_MV.shape
        if m != len(rows):
            raise ValueError(f"Sampler: {m} logit rows for {len(rows)} requests")
        if m == 0:
            return SamplerOutput([], [])
        logits_MV = logits_MV.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits_MV.log_softmax(-1) if any(want_logprobs) else None
        device = logits_MV.device
        ruled = [i for i, r in enumerate(rows) if has_token_rules(r.params)]
        if ruled:
            logits_MV = logits_MV.clone()
            logits_MV[ruled] = apply_token_rules(logits_MV[ruled], [rows[i].params for i in ruled], [rows[i].output_token_ids for i in ruled])
        constrained = any(r.params.structured_outputs is not None for r in rows)
        if constrained:
            logits_MV = logits_MV.clone()
        picked = self.grammars.mask(logits_MV, rows, verifying) if constrained or len(self.grammars) else []

        early = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
        masked = [(i, t) for i in early for t in rows[i].stop_token_ids if t < vocab]
        if masked:
            logits_MV = logits_MV.clone()
            idx = torch.tensor(masked, dtype=torch.int64, device=device)
            logits_MV[idx[:, 0], idx[:, 1]] = float("-inf")

        pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if pen:
            logits_MV = logits_MV.clone()
            logits_MV[pen] = apply_penalties(logits_MV[pen], [rows[i] for i in pen])

        tokens = self.argmax(logits_MV)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            sub = logits_MV[rand] / torch.tensor([rows[i].params.temperature for i in rand], device=device)[:, None]
            top_k = torch.tensor([rows[i].params.top_k or vocab for i in rand], device=device)
            top_p = torch.tensor([rows[i].params.top_p for i in rand], dtype=torch.float32, device=device)
            min_p = torch.tensor([rows[i].params.min_p for i in rand], dtype=torch.float32, device=device)
            probs = apply_top_k_top_p_min_p(sub, top_k, top_p, min_p).softmax(-1)
            q = torch.empty(len(rand), vocab, device=device)
            shared = [j for j, i in enumerate(rand) if rows[i].generator is None]
            if shared:
                q[shared] = torch.empty(len(shared), vocab, device=device).exponential_(generator=self._on(device, self.generator))
            for j, i in enumerate(rand):
                gen = rows[i].generator
                if gen is not None:
                    q[j] = torch.empty(vocab, device=device).exponential_(generator=self._on(device, gen))
            tokens[rand] = (probs / q).argmax(-1)

        token_list = tokens.tolist()
        if picked:
            self.grammars.advance(picked, token_list)
        logprobs: list[TokenLogprobs | None] = [None] * m
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                k = r.params.logprobs
                if k is None:
                    continue
                logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], k)
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _on(device: torch.device, generator: torch.Generator) -> torch.Generator:
        if generator.device.type != device.type:
            raise ValueError(
                f"Sampler: a generator on {generator.device} for logits on {device}: draws are made on the logits' device, "
                "so its generators must be there too (LLMEngine makes them so)"
            )
        return generator
