"""LLM: the offline API -- build or load a model, generate for a list of prompts, get texts, token ids, finish reasons, timings.

`model` is what serve/loading.py resolves (a preset name or a checkpoint folder) or an already built module with a
`.config`. On CPU a model loaded here
keeps its large projections also in oneDNN's blocked layout (EngineConfig.pack_cpu_weights, a second copy of them); a module
passed in is left as it is, since its owner may still change its weights. `pack_cpu_weights=True / False` overrides both.

`ep=N` runs the model expert-parallel over N local ranks: this process is rank 0 and drives, N - 1 spawned workers hold the
other experts (openk3.parallel.serving.local; docs/ep.md). Call close() (or use `with LLM(...) as llm:`) to stop them and leave the
process group. Prefix caching is refused with ep > 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch

from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.loading import build_model, model_tokenizer
from openk3.serve.output import OutputKind, OutputProcessor, RequestOutput
from openk3.serve.runner import CausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | Path | torch.nn.Module = "tiny",
        tokenizer: Tokenizer | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        long_prefill_token_threshold: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        cache_memory_bytes: int = 256 * 2**20,
        enable_prefix_caching: bool = False,
        prefix_match_unit: int = 64,
        prefix_snapshot_interval: int | None = None,
        num_snapshot_slots: int | None = None,
        cpu_offload_bytes: int = 0,
        disk_offload_dir: str | None = None,
        disk_offload_bytes: int = 0,
        ep: int = 1,
        ep_method: str = "moonep",
        ep_threads: int = 1,
        pack_cpu_weights: bool | None = None,
    ) -> None:
        net: CausalLM
        self._ep = None
        if ep != 1:
            from openk3.parallel.serving.local import LocalEP
            from openk3.parallel.serving.ranks import EPConfig

            ep_config = EPConfig(ep, ep_method)
            if enable_prefix_caching:
                raise ValueError(f"enable_prefix_caching=True with ep={ep}: prefix caching is not supported expert-parallel (docs/ep.md)")
            if isinstance(model, torch.nn.Module):
                tok = tokenizer or ByteTokenizer(max(256, cast(CausalLM, model).config.vocab_size))
            else:
                tok = tokenizer or model_tokenizer(model, seed)
            self._ep = LocalEP(model, ep_config, dtype, device, seed, ep_threads)
            assert self._ep.driver is not None  # set once LocalEP is up
            net = self._ep.driver
        elif isinstance(model, torch.nn.Module):
            net = cast(CausalLM, model)  # any module obeying the contract (tests pass fakes)
            tok = tokenizer or ByteTokenizer(max(256, net.config.vocab_size))
        else:
            net, tok = build_model(model, dtype, device, seed)
            tok = tokenizer or tok
        config = EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            page_size=page_size,
            num_pages=num_pages,
            cache_memory_bytes=cache_memory_bytes,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            prefix_match_unit=prefix_match_unit,
            prefix_snapshot_interval=prefix_snapshot_interval,
            num_snapshot_slots=num_snapshot_slots,
            cpu_offload_bytes=cpu_offload_bytes,
            disk_offload_dir=disk_offload_dir,
            disk_offload_bytes=disk_offload_bytes,
            # by default only a model loaded here, which nothing else can write to
            pack_cpu_weights=not isinstance(model, torch.nn.Module) if pack_cpu_weights is None else pack_cpu_weights,
        )
        try:
            self.engine = LLMEngine(net, tok, config)
        except BaseException:
            if self._ep is not None:
                self._ep.close()
            raise
        self.tokenizer = tok
        self.processor = OutputProcessor(self.engine)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the disk tier's writer thread and remove its files; with ep > 1, stop the worker ranks and leave the group."""
        try:
            self.engine.close()
        finally:
            if self._ep is not None:
                self._ep.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def model(self) -> CausalLM:
        return self.engine.model

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
            params = [sampling_params or SamplingParams()] * len(prompts)
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
            while self.engine.has_unfinished():
                for out in self.processor.process(self.engine.step()):
                    done[out.request_id] = out
        except BaseException:
            for request_id in ids:
                self.processor.abort(request_id)
            raise
        return [done[request_id] for request_id in ids]
