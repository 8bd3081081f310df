"""LLMEngine, the engine core: scheduler, cache and runner stepped together, on token ids only.

`add_request` queues a prompt of token ids (one sample); `step` schedules, runs the model, appends the sampled tokens, applies
every stop rule (serve/stopping.py: length, stop tokens, stop strings, and the text they need) and reports per request only
what is new (EngineCoreOutput: the new token ids, their logprobs and text, why it ended); `finish` and `abort` end a request
anywhere in its life. The n samples of a caller's request and how text reaches callers belong to the OutputProcessor
(output.py). A request with `return_routing` gets its experts of every MoE layer for every token run with its last output
(serve/routing.py); `weights_changed` rekeys the prefix cache after the weights were replaced in place (openk3.rl.weight_sync).
Single-threaded: the caller (LLM, or the async frontend's engine thread) owns the engine. What drivers and the server
read of an engine (EngineCore, ServedEngine, EngineStats) is serve/engine_api.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from openk3.config.vision import VisionConfig
from openk3.model.eagle3_mla import AnyEagle3Head
from openk3.model.model import K3ForCausalLM
from openk3.model.mtp import MTPLayer
from openk3.serve.cache import handoff
from openk3.serve.cache.hashing import model_salt
from openk3.serve.cache.stats import prefix_cache_stats
from openk3.serve.config import EngineConfig
from openk3.serve.eagle3_draft import Eagle3Proposer
from openk3.serve.encoder_cache import EncoderCache
from openk3.serve.engine_api import EngineStats
from openk3.serve.engine_setup import build_cache, build_proposer, check_drafts
from openk3.serve.graphs import CudaGraphCapture, DecodeGraphs
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.mtp_draft import MTPProposer
from openk3.serve.policy import check_priority
from openk3.serve.prompt_check import check_prompt
from openk3.serve.prompt_logprobs import PromptScores
from openk3.serve.request import EngineCoreOutput, Request, RequestMetrics, RequestStatus
from openk3.serve.routing import RoutingParts, RoutingRecorder, RoutingTrace, moe_layers
from openk3.serve.runner import CausalLM, ModelRunner
from openk3.serve.sampler import Sampler
from openk3.serve.sampling import SamplingParams
from openk3.serve.scheduler import Scheduler
from openk3.serve.spec_logits import sampling_row
from openk3.serve.speculative import SpecDecodeStats, SpeculativeConfig, propose_drafts
from openk3.serve.stopping import NewText, RequestText, token_stop
from openk3.serve.tokenizer import Tokenizer


def _param(model: CausalLM) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        checkpoint_eos: Sequence[int] = (),
        draft_model: CausalLM | None = None,
        speculative: SpeculativeConfig | None = None,
        mtp_layer: MTPLayer | None = None,
        eagle3_head: AnyEagle3Head | None = None,
        latent_shards: int = 1,
    ) -> None:
        """`draft_model`: speculative decoding with this model as the draft (serve/speculative.py; it shares the
        tokenizer); `mtp_layer`: with the checkpoint's multi-token-prediction layer as the draft (serve/mtp_draft.py; it
        reads the target's hidden states); `eagle3_head`: with an EAGLE-3 head (serve/eagle3_draft.py; it reads three
        layers' hidden states); `speculative` drafts per step. `latent_shards` > 1: the model is a decode-context-parallel
        driver whose ranks each hold 1/latent_shards of every MLA page (parallel/cp/sharded_mla.py): this process's pools
        are its share, and the cache memory holds that many times the pages."""
        self.config = config or EngineConfig()
        self.model = model
        self.model_config = model.config
        self.tokenizer = tokenizer
        p = _param(model)
        self.device = p.device if p is not None else torch.device("cpu")
        cache_dtype = self.config.cache_dtype or (p.dtype if p is not None else torch.float32)
        cfg = self.config
        self._spec = speculative or SpeculativeConfig()
        speculating = check_drafts(cfg, draft_model, mtp_layer, eagle3_head)
        self.cache, num_pages = build_cache(model, cfg, cache_dtype, self.device, self._spec.num_speculative_tokens if speculating else 0, latent_shards)
        capacity = num_pages * cfg.page_size
        self.max_model_len = cfg.max_model_len or min(self.model_config.max_position_embeddings, capacity)
        if self.max_model_len > capacity:
            raise ValueError(
                f"EngineConfig.max_model_len={self.max_model_len} does not fit in the cache: {num_pages} pages x {cfg.page_size} tokens = {capacity}"
            )
        self.scheduler = Scheduler(cfg.scheduler, self.cache)
        sampler = Sampler(cfg.seed, self.device)
        self.runner = ModelRunner(model, self.cache, sampler, self.device, self.max_model_len)
        if isinstance(model, torch.nn.Module) and moe_layers(model):
            self.runner.routing = RoutingRecorder(model)  # records only the steps of requests that ask (return_routing)
        self._routing: dict[str, RoutingParts] = {}  # what each request that asked has run so far
        self.encoder_cache: EncoderCache | None = None  # image inputs: a model with a vision tower (serve/encoder_cache.py)
        if isinstance(model, K3ForCausalLM) and model.vision is not None:
            self.encoder_cache = EncoderCache(model.encode_images, cfg.encoder_cache_tokens, self.device)
            self.runner.encoder_cache = self.encoder_cache
            self.scheduler.encoder_cost = self.encoder_cache.cost
        self._cache_dtype = cache_dtype
        self.weight_version = 0  # weights_changed() counts the in-place updates (parallel/weight_update.py)
        self.proposer = build_proposer(model, cfg, self._spec.num_speculative_tokens, self.max_model_len, self.runner, draft_model, mtp_layer, eagle3_head)
        if cfg.cuda_graphs:
            capture = CudaGraphCapture(self.device)
            max_batch = cfg.cuda_graph_max_batch or cfg.max_num_seqs
            self.runner.graphs = DecodeGraphs(self.runner.model, self.cache, capture, max_batch, self.max_model_len, self.device)
        self._texts: dict[str, RequestText] = {}  # each unfinished request's text and stop strings (stopping.py)
        self._prompt_scores = PromptScores()  # prompt logprobs scored so far, until the first token takes them along
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.model_config.eos_token_id
        # the checkpoint's end tokens (generation_config.json) end a reply whatever tokenizer serves it (masked by min_tokens)
        self._also_eos = frozenset(checkpoint_eos) - {self._eos}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        group_id: str | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        """Queue one sample of a prompt given as token ids (OutputProcessor.add_request takes text and n > 1); `group_id`:
        the caller's request this sample belongs to, so that its samples share slots fairly with other requests; `images`:
        the prompt's images and where their media tokens are (serve/media_prompt.py expand_media)."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if images and self.encoder_cache is None:
            raise ValueError("this model has no vision tower: image input is not supported")
        ids = list(prompt_token_ids)
        self.check_prompt(ids)
        check_priority(self.scheduler.config.policy, params.priority, request_id)  # before anything of it is kept
        # a seeded request draws from its own generator, made where the sampler draws (the model's device)
        generator = None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        req = Request(request_id, ids, params, eos_token_id=self._eos, group_id=group_id, generator=generator, also_eos=self._also_eos, images=images)
        self._texts[request_id] = RequestText(self.tokenizer, ids, params)
        self.scheduler.add_request(req)
        self._prompt_tokens_total += len(ids)

    @property
    def vision(self) -> VisionConfig | None:
        return self.model.vision if isinstance(self.model, K3ForCausalLM) and self.encoder_cache is not None else None

    def _take_routing(self, req: Request) -> RoutingTrace | None:
        parts = self._routing.pop(req.request_id, None)
        if not req.sampling_params.return_routing:
            return None
        assert parts is not None and self.runner.routing is not None
        return parts.trace(self.runner.routing.layers, req.num_tokens - 1)  # the last token was sampled, never run

    def weights_changed(self) -> int:
        """The model's weights were replaced in place, between requests (openk3.rl.weight_sync): the prefix cache is keyed
        by the new weights' salt, so no state computed with the old ones is hit. Returns the new weight version."""
        if self.has_unfinished():
            raise RuntimeError("weights changed while requests are running: update the weights between rollouts, with the engine idle")
        if self.cache.prefix is not None:
            model = self.model if isinstance(self.model, torch.nn.Module) else None
            self.cache.prefix.rekey(model_salt(self.model_config, model, self._cache_dtype, self.config.fp8_latent))
        self.weight_version += 1
        return self.weight_version

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt this engine cannot take (serve/prompt_check.py: empty, ids outside the vocabulary, no room left
        for a completion token): a PromptError, a ValueError."""
        check_prompt(ids, self.model_config.vocab_size, self.max_model_len)

    def finish(self, request_id: str, status: RequestStatus) -> RequestMetrics | None:
        """End a request wherever it is (frees its pages and slot at once); its metrics, or None for an unknown id."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(request_id, status)
        if self.proposer is not None:
            self.proposer.release({r.request_id for r in self.scheduler.running})
        self._texts.pop(request_id, None)
        self._prompt_scores.drop(request_id)
        self._routing.pop(request_id, None)
        req.timings.finished = time.monotonic()
        if self.config.check_integrity_when_idle and not self.scheduler.has_unfinished():
            self.check_integrity()  # a request the output processor finished (a stop string) can be the last one
        return req.metrics()

    def abort(self, request_id: str) -> None:
        self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    num_engines = 1  # ServedEngine: one engine

    def was_scheduled(self, request_id: str) -> bool | None:
        """Whether a request has been scheduled at least once (its queue wait is over); None for an unknown id."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.timings.first_scheduled is not None

    def unscheduled_request_ids(self) -> list[str]:
        """The requests still waiting for their first step (all in the waiting queue, with requests preempted back there)."""
        return [r.request_id for r in self.scheduler.waiting if r.timings.first_scheduled is None]

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.runner.graphs is not None:
            self.runner.graphs.check_integrity()
        if self.encoder_cache is not None:
            self.encoder_cache.check_integrity()
        if isinstance(self.proposer, (MTPProposer, Eagle3Proposer)):
            self.proposer.check_integrity({r.request_id for r in self.scheduler.running})
        self.runner.sampler.grammars.check_integrity([sampling_row(r) for r in self.scheduler.running], self.model_config.vocab_size)
        if not self.has_unfinished():
            # Pages the prefix index holds are accounted by cache.check_integrity; no request may hold anything.
            if self.cache.num_request_holders or self.cache.num_free_slots != self.cache.state_pool.num_slots:
                raise AssertionError("engine is idle but cache pages or slots are still held")

    def export_prefix(self, tokens: list[int]) -> bytes | None:
        """Prefill side of a disaggregated request: the cached prefix exactly at boundary len(tokens) as one checksummed
        record (serve/cache/handoff.py has the protocol), or None when no tier holds it. Needs prefix caching."""
        return handoff.export_prefix(self.cache, tokens)

    def import_prefix(self, record: bytes) -> int:
        """Decode side: hold a record from export_prefix where the next request with that prefix hits it; returns its
        boundary in tokens. Raises TierRecordError (a ValueError) for a corrupted record or another model's cache shape."""
        return handoff.import_prefix(self.cache, record)

    def close(self) -> None:
        """Release what outlives a step: the disk tier's writer thread and files."""
        self.cache.close()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_cache_usage_perc=self.cache.usage,
            state_slots_used=self.cache.state_pool.num_used,
            num_pages=self.cache.num_pages,
            num_free_pages=self.cache.num_free_pages,
            num_state_slots=self.cache.state_pool.num_slots,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache=prefix_cache_stats(self.cache),
            spec_decode=self.spec_stats,
        )

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's acceptance counters (None without a draft)."""
        return None if self.proposer is None else self.runner.spec_stats

    def _stops(self, req: Request, new_tokens: list[int]) -> tuple[RequestStatus | None, list[int], NewText]:
        """Every stop rule over the tokens just appended, in order (a speculative run was already cut at the first token the
        length or stop-token rules end it on, so only the last is checked for those): the status, the tokens kept (a stop
        string inside a run drops the tokens after it from the request) and their text."""
        texts = self._texts[req.request_id]
        new_text, dropped = "", 0
        status: RequestStatus | None = None
        for i, token in enumerate(new_tokens):
            after = len(new_tokens) - 1 - i  # tokens of the run after this one
            status = token_stop(req, token, self.max_model_len, self._eos) if after == 0 else None
            text = texts.add(token, status, req.num_output_tokens - after)
            cut = min(text.dropped, len(new_text))  # a cut into this step's own text is made here, the rest reported
            new_text, dropped = new_text[: len(new_text) - cut] + text.text, dropped + text.dropped - cut
            if text.stop is not None:  # a stop string wins over the length
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, text.stop
                if after:
                    del req.token_ids[-after:]  # its state then covers more than its tokens: finish snapshots nothing
                return status, new_tokens[: i + 1], NewText(new_text, dropped, text.stop)
        return status, new_tokens, NewText(new_text, dropped)

    def step(self) -> list[EngineCoreOutput]:
        """One scheduling step; returns an output for each request that received a token (with only that token)."""
        speculating = False
        if self.proposer is not None:
            grammars, vocab = self.runner.sampler.grammars, self.model_config.vocab_size
            speculating = propose_drafts(self.proposer, self._spec, self.scheduler.running, self.max_model_len, grammars, vocab)
        out = self.scheduler.schedule()
        if out.is_empty and self.scheduler.has_unfinished():
            raise RuntimeError(
                f"scheduler made no progress: {self.scheduler.num_waiting} waiting, {self.scheduler.num_running} running, "
                f"{self.cache.num_free_pages} free pages, {self.cache.num_free_slots} free slots"
            )
        result = self.runner.execute(out)
        for request_id, (start, scores) in result.prompt_logprobs.items():
            self._prompt_scores.add(request_id, start, scores)
        for request_id, (start, rows) in result.routing.items():
            self._routing.setdefault(request_id, RoutingParts()).add(start, rows)
        outputs = []
        now = time.monotonic()
        for req in self.scheduler.update_from_output(out, result.token_ids, result.runs):
            run = result.runs.get(req.request_id)
            new_tokens = run if run is not None else [req.token_ids[-1]]
            self._generation_tokens_total += len(new_tokens)
            if req.timings.first_token is None:
                req.timings.first_token = now
            req.timings.last_token = now
            lp = result.logprobs.get(req.request_id)
            run_lp = result.run_logprobs.get(req.request_id)
            prompt_logprobs = None
            if req.num_output_tokens == 1 and req.sampling_params.prompt_logprobs is not None:
                prompt_logprobs = self._prompt_scores.take(req.request_id) or ()  # () for a one-token prompt: nothing to score
            status, new_tokens, text = self._stops(req, new_tokens)
            logprobs = (lp,) if lp is not None else None if run_lp is None else tuple(run_lp[: len(new_tokens)])
            metrics, routing = None, None
            if status is not None:
                routing = self._take_routing(req)
                self.scheduler.finish(req.request_id, status)
                del self._texts[req.request_id]
                req.timings.finished = now
                metrics = req.metrics()
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    tuple(new_tokens),
                    logprobs,
                    req.num_cached_tokens,
                    req.status.finish_reason,
                    req.stop_reason,
                    metrics,
                    text.text,
                    text.dropped,
                    prompt_logprobs,
                    routing,
                )
            )
        if isinstance(self.proposer, (MTPProposer, Eagle3Proposer)) and speculating:
            self.proposer.observe(result.hidden, self.scheduler.running)
        elif isinstance(self.proposer, (MTPProposer, Eagle3Proposer)):
            # a step without speculation skips the layer or head too (the point of disable_by_batch_size): when
            # speculation resumes, it starts over at the rows it is then given (serve/mtp_draft.py, serve/eagle3_draft.py)
            self.proposer.release({r.request_id for r in self.scheduler.running})
        if self.config.check_integrity_when_idle and not self.scheduler.has_unfinished():
            self.check_integrity()
        return outputs
