"""DecodeGraphs: decode steps replayed from graphs captured per batch-size bucket, as vLLM and nano-vllm do with CUDA graphs.

Legend: n sequences in the step, B its bucket (the smallest captured size >= n), P pages per sequence in a graph
(max_model_len / page_size, rounded up), V vocabulary.

Why: a decode step of a small model is hundreds of small kernels, and launching them from Python costs more than running
them. A graph records the launches of one forward once and replays them as one: same kernels, same shapes, same
addresses. So each bucket owns static input buffers that the step is copied into, and its logits buffer is what the
replay refills. What may differ from step to step is only the values in those buffers, which is why the captured
forward may read nothing back to the host (model/batch.py `capturable`; the routed experts take their fixed-shape form
while capturing, ops/capture.py).

Padding: the rows n..B of a bucket are sequences with no context, one token, state slot `cache.scratch_slot` and every
page `cache.scratch_page` (CacheManager(scratch=True) keeps both out of the pools), so they write only where no request
reads. Prefill and mixed steps, steps wider than the largest bucket and contexts longer than P pages run eagerly.

The sampler runs after the replay, outside the graph, on the bucket's logits rows 0..n-1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.ops.capture import graph_capture
from openk3.serve.cache.manager import CacheManager


class Captured(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """capture(fn) runs fn once while recording it and returns the graph and fn's output, which every replay refills."""

    warm_start: bool  # capture every bucket when the engine starts (on the real device) rather than at first use

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Captured, torch.Tensor]: ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every bucket in one memory pool (steps run one at a time, so their graphs never overlap)."""

    warm_start = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device} (CUDA available: {torch.cuda.is_available()})")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Captured, torch.Tensor]:
        # torch's rule: run once on a side stream first, so lazy initialisation (cuBLAS handles, Triton compilation and
        # autotuning) happens outside the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch (vLLM's default sizes), and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


@dataclass
class _Bucket:
    batch: ForwardBatch  # views of the static buffers, rows 0..B-1
    graph: Captured | None = None
    logits: torch.Tensor | None = None  # [B, V], refilled by every replay


class DecodeGraphs:
    def __init__(
        self, model: Callable[[ForwardBatch, CacheTensors], torch.Tensor], cache: CacheManager, capture: GraphCapture, max_batch: int, max_model_len: int
    ) -> None:
        if cache.scratch_slot is None or cache.scratch_page is None:
            raise ValueError("DecodeGraphs: the cache has no scratch slot and page for padding rows (CacheManager(scratch=True))")
        self.model, self.cache, self.capture = model, cache, capture
        self.max_pages = cache.pages_for(max_model_len)
        self.buckets = batch_buckets(max_batch)
        dev = cache.tensors.kda_state[0].device if cache.tensors.kda_state else cache.tensors.mla_latent[0].device
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.state_slots = torch.full((rows,), cache.scratch_slot, dtype=torch.int64, device=dev)
        self.page_table = torch.full((rows, self.max_pages), cache.scratch_page, dtype=torch.int64, device=dev)
        self._buckets = {b: _Bucket(self._static_batch(b, dev)) for b in self.buckets}
        self.replays = 0  # decode steps served by a replay (the engine's stats read it)

    def _static_batch(self, rows: int, dev: torch.device) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            cu_seqlens=torch.arange(rows + 1, dtype=torch.int64, device=dev),
            context_lens=self.context_lens[:rows],
            state_slots=self.state_slots[:rows],
            page_table=self.page_table[:rows],
            logits_indices=None,  # every row: a decode step samples every sequence
            is_decode=True,
            capturable=True,
        )

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket that runs this step, or None when it runs eagerly (module docstring says which steps)."""
        n = batch.num_seqs
        if not batch.is_decode or batch.page_table is None or n > self.buckets[-1] or batch.page_table.shape[1] > self.max_pages:
            return None
        if batch.logits_indices is not None and batch.logits_indices.numel() != n:
            return None
        return next(b for b in self.buckets if b >= n)

    def capture_all(self) -> None:
        """Every bucket, largest first (the smaller graphs then reuse the pool's memory)."""
        for size in reversed(self.buckets):
            self._captured(size)

    def _captured(self, size: int) -> _Bucket:
        bucket = self._buckets[size]
        if bucket.graph is None:
            self._pad(0, size)  # capture writes only to the scratch slot and page

            def forward() -> torch.Tensor:
                # a new batch object per run: what one run works out and keeps on the batch (fresh_seqs) must not reach
                # another, above all not from the warm-up run into the capture, where it would never be refilled
                with graph_capture():
                    return self.model(dataclasses.replace(bucket.batch), self.cache.tensors)

            bucket.graph, bucket.logits = self.capture(forward)
        return bucket

    def _pad(self, start: int, end: int) -> None:
        assert self.cache.scratch_slot is not None and self.cache.scratch_page is not None
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.context_lens[start:end] = 0
        self.state_slots[start:end] = self.cache.scratch_slot
        self.page_table[start:end] = self.cache.scratch_page

    def run(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """The logits [n, V] of the decode step `batch` from bucket `size` (bucket_for's answer), captured at first use."""
        assert batch.state_slots is not None and batch.page_table is not None
        n, width = batch.num_seqs, batch.page_table.shape[1]
        bucket = self._captured(size)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.context_lens[:n].copy_(batch.context_lens)
        self.state_slots[:n].copy_(batch.state_slots)
        # entries past a sequence's own pages are never read; they keep valid page ids from earlier steps
        self.page_table[:n, :width].copy_(batch.page_table)
        self._pad(n, size)
        assert bucket.graph is not None and bucket.logits is not None
        bucket.graph.replay()
        self.replays += 1
        return bucket.logits[:n]
