"""ModelRunner: applies the scheduler's diff to its own copy of the running requests, packs the step into one
variable-length ForwardBatch (sequences end to end, no padding), runs the model under inference_mode and samples. With
decode graphs (serve/graphs.py) a decode step that fits a bucket is replayed from its graph instead.

The runner runs the model as it is given: whoever builds the engine has applied the serving layout before
(openk3.launch.engine.build_engine; a multi-rank driver's ranks at start-up).
It keeps, per request, the tokens (it appends what it samples, so a decode step needs no token from the scheduler), the slot
and the page list. A request samples when its computed tokens catch up with its tokens this step; only those rows get logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors, ForwardBatch, HostFacts
from openk3.serve.cache.manager import CacheManager
from openk3.serve.graphs import DecodeGraphs
from openk3.serve.request import TokenLogprobs
from openk3.serve.sampler import Sampler, SamplingRow
from openk3.serve.sampling import SamplingParams
from openk3.serve.scheduler import RunnerOutput, SchedulerOutput


class CausalLM(Protocol):
    """What the engine needs of a model: the serve <-> model contract of openk3.model.batch."""

    config: ModelConfig

    def __call__(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


@dataclass
class _RunningState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    slot: int
    page_ids: list[int]
    num_computed_tokens: int


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheManager,
        sampler: Sampler,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = torch.device(device)
        self._reqs: dict[str, _RunningState] = {}
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from captured graphs (EngineConfig.cuda_graphs)

    @property
    def num_known(self) -> int:
        return len(self._reqs)

    def _apply_diff(self, out: SchedulerOutput) -> None:
        for req_id in out.forget_request_ids:
            self._reqs.pop(req_id, None)
        for nr in out.new_requests:
            self._reqs[nr.request_id] = _RunningState(
                token_ids=list(nr.token_ids),
                num_prompt_tokens=nr.num_prompt_tokens,
                params=nr.sampling_params,
                stop_token_ids=nr.stop_token_ids,
                generator=nr.generator,
                slot=nr.slot,
                page_ids=list(nr.page_ids),
                num_computed_tokens=nr.num_computed_tokens,
            )
        for cr in out.cached_requests:
            st = self._reqs[cr.request_id]
            if st.num_computed_tokens != cr.num_computed_tokens:
                raise AssertionError(f"runner vs scheduler on {cr.request_id}: {st.num_computed_tokens} vs {cr.num_computed_tokens}")
            st.page_ids.extend(cr.new_page_ids)

    def build_batch(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[str]]:
        """The packed step and the ids of the requests that sample, in logits-row order."""
        ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        context_lens, slots, page_rows, sampling, logits_rows = [], [], [], [], []
        for req_id, n in out.num_scheduled_tokens.items():
            st = self._reqs[req_id]
            c = st.num_computed_tokens
            if c + n > len(st.token_ids):
                raise AssertionError(f"{req_id}: scheduled {n} tokens from {c} but only {len(st.token_ids)} are known")
            if self.cache.pages_for(c + n) > len(st.page_ids):
                raise AssertionError(f"{req_id}: {c + n} tokens need {self.cache.pages_for(c + n)} pages, holds {len(st.page_ids)}")
            ids.extend(st.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            cu.append(cu[-1] + n)
            context_lens.append(c)
            slots.append(st.slot)
            page_rows.append(st.page_ids)
            if c + n == len(st.token_ids):
                sampling.append(req_id)
                logits_rows.append(cu[-1] - 1)
        # Entries past a request's own pages are never read (the model only touches pages covering its positions).
        width = max(len(p) for p in page_rows)
        table = torch.tensor([p + [0] * (width - len(p)) for p in page_rows], dtype=torch.int64)
        lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int64, device=dev),
            state_slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            page_table=table.to(dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            is_decode=all(n == 1 for n in lens),
            host_facts=HostFacts.of(context_lens, slots),
        )
        return batch, sampling

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._apply_diff(out)
        if out.is_empty:
            return RunnerOutput({}, {})
        batch, sampling = self.build_batch(out)
        with torch.inference_mode():
            bucket = self.graphs.bucket_for(batch) if self.graphs is not None else None
            if bucket is not None:
                assert self.graphs is not None
                logits = self.graphs.run(batch, bucket)
            else:
                logits = self.model(batch, self.cache.tensors)
            for req_id, n in out.num_scheduled_tokens.items():
                self._reqs[req_id].num_computed_tokens += n
            states = [(r, self._reqs[r]) for r in sampling]
            rows = [SamplingRow(st.params, st.generator, st.token_ids, st.num_prompt_tokens, st.stop_token_ids, r) for r, st in states]
            result = self.sampler(logits, rows)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for req_id, token, lp in zip(sampling, result.token_ids, result.logprobs, strict=True):
            self._reqs[req_id].token_ids.append(token)
            sampled[req_id] = token
            if lp is not None:
                logprobs[req_id] = lp
        return RunnerOutput(sampled, logprobs)
