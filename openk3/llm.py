"""LLM: the offline API -- build or load a model, generate for a list of prompts, get texts, token ids, finish reasons, timings.

`LLM(model, tokenizer=None, **overrides)`: `model` is what serve/loading.py resolves (a preset name or a checkpoint folder)
or an already built module with a `.config`; `overrides` are EngineConfig's and ParallelConfig's settings by name
(`max_num_seqs=8`, `dtype=torch.bfloat16`, `enable_prefix_caching=True`, `ep=2`, ...), checked as `openk3 serve` checks its
flags; `config=` / `parallel=` take whole config objects, which overrides then amend. `ops="kda=naive,moe=naive"` (or a
dict) names op implementations (serve/op_names.py): they are set on the model's OpChoice on every rank of a multi-rank
layout, a module's too (they become its own; with tp > 1 the ranks cut copies of it, which take them instead). On CPU a
model loaded here keeps its projections also in oneDNN's blocked layout and the C kernel's panels (pack_cpu_weights,
copies made on first use at their row counts); a module passed in is not, since its owner may still change its weights.
`pack_cpu_weights=True / False` overrides both.

`ep=N` runs the model expert-parallel over N local ranks, `tp=N` tensor-parallel (and `tp=N, ep=N` both): this process
is rank 0 and drives, N - 1 spawned workers hold the other shards (openk3.parallel.serving.local; docs/parallel.md).
`dp=N, ep=N` is data-parallel attention: every rank runs an engine of these settings over the requests rank 0 places on
it (openk3.parallel.dp). `cp=C` (with `tp=T`, and `ep=1` or `ep=C*T`) splits long prefill steps by position over C
groups of T ranks (openk3.parallel.cp). Call close() (or use `with LLM(...) as llm:`) to stop them and leave the process group. Prefix
caching works on every layout (rank 0's slot and page copies are replayed on the other ranks; with dp > 1 each rank's
engine owns its cache), and so do its host and disk tiers (ranks holding shards mirror rank 0's tiers: serve/cache/
tier_mirror.py); the ranks do not pack their projections
for CPU (pack_cpu_weights applies to a single-process engine).

`export_eplb_stats=PATH` counts the routing entries per expert of every MoE layer over every step (rank 0's model, which
sees every token: one process, ep=N, tp=N; not dp > 1) and close() writes them to PATH, the file `ep_method="eplb",
eplb_stats=PATH` places its replicas from (openk3.parallel.ep.load_stats).

The C heap setting of `openk3 serve` (serve/cpu_heap.py) is a process option: call keep_heap_for_reuse() for the same here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.options import split_overrides
from openk3.parallel.config import ParallelConfig
from openk3.serve.config import EngineConfig
from openk3.serve.engine_api import EngineCore
from openk3.serve.output import OutputKind, OutputProcessor, RequestOutput
from openk3.serve.runner import CausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from openk3.parallel.ep.load_stats import LoadRecording

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | Path | torch.nn.Module = "tiny",
        tokenizer: Tokenizer | None = None,
        *,
        config: EngineConfig | None = None,
        parallel: ParallelConfig | None = None,
        **overrides: Any,
    ) -> None:
        engine_overrides, parallel_overrides = split_overrides(overrides, EngineConfig, ParallelConfig)
        config = dataclasses.replace(config or EngineConfig(), **engine_overrides)
        parallel = dataclasses.replace(parallel or ParallelConfig(), **parallel_overrides)
        parallel.check_engine(config)
        config = config.with_packing_default(owns_model=not isinstance(model, torch.nn.Module))  # nothing else writes to it
        if not isinstance(model, torch.nn.Module):
            config.check_ops_on_device()  # before the weights load or any rank starts; a module's own device is checked as it is prepared
        # `core` is what generate() steps: the engine, or with dp > 1 the engine spread over the ranks; `engine` is this
        # process's own LLMEngine either way (with dp > 1 rank 0's, to inspect: stepping it alone would break the lockstep)
        built = build_engine(EngineSpec(model, config, parallel, tokenizer))
        self._ep = built.local_ranks
        self.core: EngineCore = built.core
        self.engine = built.local
        self.tokenizer = built.tokenizer
        self.generation = built.generation
        self.processor = OutputProcessor(self.core)
        self._ids = itertools.count()
        self._load_recording: LoadRecording | None = None
        if parallel.export_eplb_stats is not None:
            # after the engine prepared the model for serving; rank 0's model sees every token (dp > 1 is refused)
            from openk3.parallel.ep.load_stats import record_expert_load

            try:
                self._load_recording = record_expert_load(built.counted_model, parallel.export_eplb_stats)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Stop the disk tier's writer thread and remove its files; with export_eplb_stats, write the expert load counted
        (once); with ep > 1, stop the worker ranks and leave the group."""
        try:
            self.core.close()
        finally:
            try:
                self._save_expert_load()
            finally:
                if self._ep is not None:
                    self._ep.close()

    def _save_expert_load(self) -> None:
        recording, self._load_recording = self._load_recording, None
        if recording is None:
            return
        try:
            recording.save()
        finally:
            recording.detach()  # a caller's module gets its own expert backends back

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def model(self) -> CausalLM:
        return self.core.model

    def default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams: the checkpoint's generation_config.json defaults
        (vLLM's get_default_sampling_params), else SamplingParams()."""
        return SamplingParams(**self.generation.defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, each with its n completions in index order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts; expected one or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                self.processor.add_request(request_id, prompt, p, OutputKind.FINAL_ONLY)
                ids.append(request_id)
            done: dict[str, RequestOutput] = {}
            while self.core.has_unfinished():
                for out in self.processor.process(self.core.step()):
                    done[out.request_id] = out
        except BaseException:
            for request_id in ids:
                self.processor.abort(request_id)
            raise
        return [done[request_id] for request_id in ids]
