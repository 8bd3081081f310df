"""ModelRunner: packs one step of the scheduler's plan into a variable-length ForwardBatch (sequences end to end, no padding),
runs the model under inference_mode and samples. With decode graphs (serve/graphs.py) a decode step that fits a bucket is
replayed from its graph instead.

The runner runs the model as it is given: whoever builds the engine has applied the serving layout before
(openk3.launch.engine.build_engine; a multi-rank driver's ranks at start-up).
The runner keeps no request state: it reads each scheduled Request (its tokens and computed count) and the cache (its slot
and pages), and changes none of them; the scheduler applies what was sampled. A request samples when its computed tokens
catch up with its tokens this step; only those rows get logits, and the prefill rows of a request that wants its prompt
scored (serve/prompt_logprobs.py), after the sampling rows in `logits_indices`. Rows of image tokens get their images'
embeddings (`mm_embeds`, from the encoder cache, which runs the vision encoder for images it does not hold). With `keep_hidden` (a draft that reads
the target's hidden states: serve/mtp_draft.py, serve/eagle3_draft.py) the model runs as hidden_states (or
aux_hidden_states with `aux_layers`) then compute_logits, and the step's StepSamples carry each request's hidden rows at
the positions it keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors, ForwardBatch, StateCut
from openk3.serve.cache.manager import CacheManager
from openk3.serve.encoder_cache import EncoderCache
from openk3.serve.graphs import DecodeGraphs
from openk3.serve.pack import PackedRow, pack, restore_slot, save_slot
from openk3.serve.prompt_logprobs import rows_to_score, score
from openk3.serve.request import Request, TokenLogprobs
from openk3.serve.routing import RoutingRecorder
from openk3.serve.sampler import Sampler
from openk3.serve.scheduler import SchedulerOutput
from openk3.serve.spec_logits import accept_run, run_logprobs, sampling_row, verified_logits
from openk3.serve.spec_states import keep_verified_state, stepwise_verification
from openk3.serve.speculative import SpecDecodeStats, verify
from openk3.serve.stopping import tokens_kept


class CausalLM(Protocol):
    """What the engine needs of a model: the serve <-> model contract of openk3.model.batch."""

    config: ModelConfig

    def __call__(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


class HiddenStatesLM(CausalLM, Protocol):
    """A model whose forward is hidden_states then compute_logits (K3ForCausalLM): what a draft reading the target's
    hidden states needs of it."""

    def hidden_states(self, batch: ForwardBatch, cache: CacheTensors | None = None) -> torch.Tensor: ...

    def compute_logits(self, h_MD: torch.Tensor) -> torch.Tensor: ...

    def aux_hidden_states(self, batch: ForwardBatch, cache: CacheTensors | None, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class StepSamples:
    """What a step sampled: request id -> token, for the requests whose computed tokens caught up, and their logprobs
    (only for requests that asked); and request id -> (first position, scores) of the prompt tokens it scored."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> (first position, [n, L, k] expert ids) of the rows it ran, for requests that asked (serve/routing.py)
    routing: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # request id -> the tokens a speculating request keeps this step (accepted drafts, then the target's token)
    runs: dict[str, list[int]] = field(default_factory=dict)
    # with ModelRunner.keep_hidden: request id -> (first position, [n, D] last hidden states, or with aux_layers those
    # layers' hidden states side by side [n, A * D]) of the positions it keeps (every row it ran; a speculating
    # request's verified rows up to its last kept token)
    hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # request id -> the logprobs of each token of its run, for speculating requests that asked (serve/spec_logits.py)
    run_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptRows:
    """A request's prefill rows scored this step: positions `positions` of its prompt, in `logits_indices` order."""

    request: Request
    positions: range


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheManager,
        sampler: Sampler,
        device: torch.device | str = "cpu",
        max_model_len: int = 1 << 62,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from captured graphs (EngineConfig.cuda_graphs)
        self.routing: RoutingRecorder | None = None  # set by the engine where the model has MoE layers to record
        self.max_model_len = max_model_len  # where the length rule ends a speculative run (serve/stopping.py)
        self.spec_stats = SpecDecodeStats()
        self.encoder_cache: EncoderCache | None = None  # set by the engine where the model has a vision tower
        self.keep_hidden = False  # set by the engine for a draft that reads the target's hidden states (serve/mtp_draft.py)
        # with keep_hidden, the hidden rows kept are the hidden states entering these layers instead of the last (an
        # EAGLE-3 draft's aux layers: serve/eagle3_draft.py, K3Model.forward_with_aux)
        self.aux_layers: tuple[int, ...] = ()

    def build_batch(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[Request], list[Request], list[PromptRows]]:
        """The packed step, the requests that sample (in logits-row order), the requests that verify drafts (k + 1 rows
        each, after them), then the prompt rows scored (after those)."""
        rows: list[PackedRow] = []
        at = 0  # packed rows so far
        logits_rows: list[int] = []
        scored_rows: list[int] = []
        verify_rows: list[int] = []
        sampling: list[Request] = []
        verifying: list[Request] = []
        scored: list[PromptRows] = []
        for req, n in zip(out.requests, out.num_tokens, strict=True):
            c = req.num_computed_tokens
            k = len(req.draft_token_ids)
            slot, pages = self.cache.slot(req.request_id), self.cache.page_ids(req.request_id)
            if k and c + n == req.num_tokens + k:  # the scheduler gave it its drafts: verify them (serve/speculative.py)
                rows.append(PackedRow(slot, pages, c, (req.token_ids + req.draft_token_ids)[c:], wants_logits=False))
                at += n
                verifying.append(req)
                verify_rows.extend(range(at - k - 1, at))
                continue
            if c + n > req.num_tokens:
                raise AssertionError(f"{req.request_id}: scheduled {n} tokens from {c} but only {req.num_tokens} are known")
            if self.cache.pages_for(c + n) > len(pages):
                raise AssertionError(f"{req.request_id}: {c + n} tokens need {self.cache.pages_for(c + n)} pages, holds {len(pages)}")
            rows.append(PackedRow(slot, pages, c, req.token_ids[c : c + n], wants_logits=False))
            at += n
            if c + n == req.num_tokens:
                sampling.append(req)
                logits_rows.append(at - 1)
            prompt_positions = rows_to_score(req, c, n)
            if prompt_positions:
                scored.append(PromptRows(req, prompt_positions))
                scored_rows.extend(range(at - n + prompt_positions.start - c, at - n + prompt_positions.stop - c))
        batch = pack(rows, self.device, logits_rows + verify_rows + scored_rows)
        mm = self.encoder_cache.step_rows(out.requests, out.num_tokens) if self.encoder_cache is not None else None
        if mm is not None:  # the placeholder rows of images take the images' embeddings (serve/encoder_cache.py)
            batch = dataclasses.replace(batch, mm_embeds=mm[0], mm_rows=mm[1])
        if out.cuts:
            starts = [r.num_computed_tokens for r in out.requests]
            batch = dataclasses.replace(batch, state_cuts=tuple(StateCut(c.row, c.num_tokens - starts[c.row], c.slot) for c in out.cuts))
        return batch, sampling, verifying, scored

    def execute(self, out: SchedulerOutput) -> StepSamples:
        """Run one planned step: forward the packed batch and sample the rows whose requests caught up, verify the drafts
        of the requests that have them (rolling their KDA slots back to the kept tokens). Requests are read, never changed
        (the scheduler's update_from_output advances them)."""
        if out.is_empty:
            return StepSamples({}, {})
        batch, sampling, verifying, scored = self.build_batch(out)
        recorded = [i for i, r in enumerate(out.requests) if r.sampling_params.return_routing]
        stepwise = None if scored else stepwise_verification(out, batch, verifying, self.cache)
        kept_slots: dict[str, list[int]] = {}
        if stepwise is not None:  # per-position KDA states: a rejection is one slot copy (serve/spec_states.py)
            batch, kept_slots = stepwise
        with torch.inference_mode():
            saved = {r.request_id: save_slot(self.cache, self.cache.slot(r.request_id)) for r in verifying if stepwise is None}
            # a graph returns the logits of every row in batch order, not sampling rows then scored or verified ones; and it
            # runs no Python, so a step that records its routing runs eagerly
            eager = scored or verifying or recorded or self.keep_hidden
            bucket = self.graphs.bucket_for(batch) if self.graphs is not None and not eager else None
            if bucket is not None:
                assert self.graphs is not None
                logits, hidden_TD = self.graphs.run(batch, bucket), None
            elif recorded:
                if self.routing is None:
                    raise ValueError("return_routing: this engine's model has no MoE layers it can record (a single-process engine)")
                with self.routing.step():
                    logits, hidden_TD = self._forward(batch)
            else:
                logits, hidden_TD = self._forward(batch)
            result = self.sampler(logits[: len(sampling)], [sampling_row(r) for r in sampling], [sampling_row(r) for r in verifying])
            at = len(sampling)
            runs: dict[str, list[int]] = {}
            run_logprobs: dict[str, list[TokenLogprobs]] = {}
            redo: list[PackedRow] = []
            for req in verifying:
                k = len(req.draft_token_ids)
                runs[req.request_id] = run = self._verify(req, logits[at : at + k + 1], run_logprobs)
                at += k + 1
                if stepwise is not None:
                    keep_verified_state(self.cache, req, kept_slots[req.request_id], len(run))
                elif len(run) < k + 1:  # put the slot back and recompute the kept prefix: pending token + accepted drafts
                    c, slot = req.num_computed_tokens, self.cache.slot(req.request_id)
                    restore_slot(self.cache, slot, saved[req.request_id])
                    redo.append(PackedRow(slot, self.cache.page_ids(req.request_id), c, (req.token_ids + run)[c : req.num_tokens + len(run) - 1]))
            if redo:
                self.model(pack(redo, self.device), self.cache.tensors)  # one forward for every rollback of the step
            prompt_logprobs = self._score_prompts(logits[at:], scored)
        logprobs = {r.request_id: lp for r, lp in zip(sampling, result.logprobs, strict=True) if lp is not None}
        routing = {}
        if recorded:
            assert self.routing is not None
            experts_TLk, cu = self.routing.rows(), batch.cu_seqlens.tolist()
            for i in recorded:
                req = out.requests[i]
                routing[req.request_id] = (req.num_computed_tokens, experts_TLk[cu[i] : cu[i + 1]])
        tokens = {r.request_id: t for r, t in zip(sampling, result.token_ids, strict=True)}
        hidden = self._kept_hidden(out, batch, hidden_TD, runs) if hidden_TD is not None else {}
        return StepSamples(tokens, logprobs, prompt_logprobs, routing, runs, hidden, run_logprobs)

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of the batch's logits rows, and with keep_hidden the hidden rows kept of every row (the last hidden
        states, or the aux layers' side by side)."""
        if not self.keep_hidden:
            return self.model(batch, self.cache.tensors), None
        model = cast(HiddenStatesLM, self.model)
        if self.aux_layers:
            hidden_TD, kept_TD = model.aux_hidden_states(batch, self.cache.tensors, self.aux_layers)
        else:
            hidden_TD = kept_TD = model.hidden_states(batch, self.cache.tensors)
        rows = hidden_TD if batch.logits_indices is None else hidden_TD[batch.logits_indices]
        return model.compute_logits(rows), kept_TD

    @staticmethod
    def _kept_hidden(out: SchedulerOutput, batch: ForwardBatch, hidden_TD: torch.Tensor, runs: dict[str, list[int]]) -> dict[str, tuple[int, torch.Tensor]]:
        """Each request's hidden rows at the positions it keeps: all it ran, or a verification's up to its last kept token
        (the pending token and the accepted drafts; the rows after them saw rejected tokens)."""
        cu = batch.cu_seqlens.tolist()
        kept = {}
        for i, req in enumerate(out.requests):
            run = runs.get(req.request_id)
            end = cu[i + 1] if run is None else cu[i] + len(run)
            kept[req.request_id] = (req.num_computed_tokens, hidden_TD[cu[i] : end])
        return kept

    def _verify(self, req: Request, logits_KV: torch.Tensor, logprobs: dict[str, list[TokenLogprobs]]) -> list[int]:
        """The tokens a request keeps from its drafts (serve/speculative.py) on the distributions plain decoding would
        sample at each position (serve/spec_logits.py), cut at the first a stop rule ends it on; their logprobs go into
        `logprobs` when the request asks, and its grammar reads them."""
        drafts, params = req.draft_token_ids, req.sampling_params
        generator = req.generator if req.generator is not None else self.sampler.generator
        grammars = self.sampler.grammars
        run, accepted = verify(verified_logits(logits_KV, req, grammars), drafts, req.draft_probs, params, generator)
        run = run[: tokens_kept(req, run, self.max_model_len)]
        accept_run(grammars, req, run, logits_KV.shape[1])
        self.spec_stats.record(len(drafts), min(accepted, len(run) - 1))
        if params.logprobs is not None:
            logprobs[req.request_id] = run_logprobs(logits_KV, run, params.logprobs)
        return run

    @staticmethod
    def _score_prompts(logits_RV: torch.Tensor, scored: list[PromptRows]) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        if not scored:
            return {}
        targets = [p.request.token_ids[q + 1] for p in scored for q in p.positions]
        top_k = [p.request.sampling_params.prompt_logprobs or 0 for p in scored for _ in p.positions]
        scores = score(logits_RV, targets, top_k)
        out, at = {}, 0
        for p in scored:
            out[p.request.request_id] = (p.positions.start, scores[at : at + len(p.positions)])
            at += len(p.positions)
        return out
