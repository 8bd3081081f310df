"""DecodeGraphs: decode steps replayed from graphs captured per (batch, page-table width) bucket, as vLLM and nano-vllm do
with CUDA graphs.

Legend: n sequences in the step, B its batch bucket (the smallest captured size >= n), W its width bucket (pages per
sequence, the smallest power of two >= the step's page-table width, at most P = max_model_len / page_size), V vocabulary.

Why: a decode step of a small model is hundreds of small kernels, and launching them from Python costs more than running
them. A graph records the launches of one forward once and replays them as one: same kernels, same shapes, same
addresses. So the step is copied into static input buffers, and the replay refills the logits buffer. What may differ
from step to step is only the values in those buffers, which is why the captured forward may read nothing back to the
host (model/batch.py `capturable`).

- Width buckets: the torch MLA decode form attends over every page of the table, masked, so a graph of width P would
  cost a 1M-token context on every step. Powers of two keep the waste under 2x.
- Captured at first use, each bucket once: a graph exists only for the shapes traffic brings, and the first step of a
  bucket pays its capture.
- The routed experts run a form chosen by name for the graph (`graph_expert_form`): the sized forms size their work by
  the routing on the host. Eager steps keep the model's own choice, so a graphed step's expert sums may differ from an
  eager step's by rounding.
- Padding: the rows n..B are sequences with no context, one token, state slot `cache.scratch_slot` and every page
  `cache.scratch_page` (CacheManager(scratch=True) keeps both out of the pools), so they write only where no request
  reads.
- Run eagerly: prefill and mixed steps, steps wider than the largest batch bucket, and contexts longer than P pages.
- The sampler runs after the replay, outside the graph, on logits rows 0..n-1 of one buffer every graph writes into.

Contract: a graph keeps the kernels and addresses of its capture, so once a bucket is captured the model's parameters may
change only in place (copy_), and its ops and expert backends not at all (select_ops, set_expert_backend).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from openk3.model.batch import ForwardBatch
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import LocalExperts
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.registry import OpTarget
from openk3.serve.cache.manager import CacheManager

# Routed-expert forms whose work does not depend on the routing's values on the host (ops/registry.py "moe_experts").
CAPTURABLE_EXPERT_FORMS = ("static", "triton")


class Captured(Protocol):
    def replay(self) -> None: ...


GraphCapture = Callable[[Callable[[], torch.Tensor]], Captured]  # capture(fn): run fn once while recording it


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every bucket in one memory pool: steps run one at a time and each graph's output is copied
    into the shared logits buffer inside the graph, so no graph's memory outlives its replay."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device} (CUDA available: {torch.cuda.is_available()})")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Captured:
        # torch's rule: run first on a side stream, so lazy initialisation (cuBLAS workspaces, Triton compilation and
        # autotuning) happens outside the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_batch (vLLM's default sizes), and max_batch itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def width_buckets(max_pages: int) -> list[int]:
    """Powers of two below max_pages, and max_pages itself."""
    sizes, w = [], 1
    while w < max_pages:
        sizes.append(w)
        w *= 2
    return sizes + [max_pages]


def graph_expert_form(current: str, bank_is_packed: bool, device: torch.device) -> str:
    """The routed-expert form a graph runs: the model's own when capturable; else the Triton grouped GEMM for packed
    MXFP4 experts on CUDA (reads them packed), else the fixed-shape form (every expert over every row: E / k times the
    routed rows' arithmetic, and the whole bank read per layer; ops/moe/static.py)."""
    if current in CAPTURABLE_EXPERT_FORMS:
        return current
    return "triton" if bank_is_packed and device.type == "cuda" else "static"


class DecodeGraphs:
    def __init__(self, model: object, cache: CacheManager, capture: GraphCapture, max_batch: int, max_model_len: int, device: torch.device) -> None:
        if not isinstance(model, K3ForCausalLM):
            raise ValueError(f"cuda_graphs=True captures the engine's own K3ForCausalLM, not a {type(model).__name__}")
        if cache.scratch_slot is None or cache.scratch_page is None:
            raise ValueError("DecodeGraphs: the cache has no scratch slot and page for padding rows (CacheManager(scratch=True))")
        self.model, self.cache, self.capture, self.device = model, cache, capture, device
        self.buckets = batch_buckets(max_batch)
        self.widths = width_buckets(cache.pages_for(max_model_len))
        rows, pages = self.buckets[-1], self.widths[-1]
        self.input_ids, self.positions, self.context_lens, self.state_slots = (torch.empty(rows, dtype=torch.int64, device=device) for _ in range(4))
        self.page_table = torch.empty(rows, pages, dtype=torch.int64, device=device)
        self._pad(0, rows)  # every row padding until a step fills it
        self.logits = torch.zeros(rows, model.config.vocab_size, dtype=model.lm_head.weight.dtype, device=device)
        self._graphs: dict[tuple[int, int], Captured] = {}
        self.replays = 0  # decode steps served by a replay

    def bucket_for(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """(batch bucket, width bucket) that runs this step, or None when it runs eagerly (module docstring)."""
        n = batch.num_seqs
        if not batch.is_decode or batch.page_table is None or n > self.buckets[-1] or batch.page_table.shape[1] > self.widths[-1]:
            return None
        if batch.logits_indices is not None and batch.logits_indices.numel() != n:
            return None
        width = batch.page_table.shape[1]
        return next(b for b in self.buckets if b >= n), next(w for w in self.widths if w >= width)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def check_integrity(self) -> None:
        """Every graph is a bucket's, and the static buffers address only real or scratch slots and pages (a replay's
        stale rows are padding or an earlier step's, never an id outside the pools)."""
        for rows, pages in self._graphs:
            if rows not in self.buckets or pages not in self.widths:
                raise AssertionError(f"DecodeGraphs: a graph for batch {rows} x {pages} pages, buckets {self.buckets} x {self.widths}")
        assert self.cache.scratch_slot is not None and self.cache.scratch_page is not None
        if not bool(((self.state_slots >= 0) & (self.state_slots <= self.cache.scratch_slot)).all()):
            raise AssertionError(f"DecodeGraphs: static state slots outside 0..{self.cache.scratch_slot}")
        if not bool(((self.page_table >= 0) & (self.page_table <= self.cache.scratch_page)).all()):
            raise AssertionError(f"DecodeGraphs: static page table entries outside 0..{self.cache.scratch_page}")

    @contextlib.contextmanager
    def _graph_experts(self) -> Iterator[None]:
        """The layers' routed experts in their graph form while a graph's forward runs (module docstring), then as before."""
        target = OpTarget(self.device.type)
        saved = []
        for moe in self.model.moe_layers():
            if not isinstance(moe.backend, LocalExperts):
                raise ValueError(f"cuda_graphs=True: MoE layer {moe.layer_index} runs {type(moe.backend).__name__}, graphs capture local experts only")
            form = graph_expert_form(moe.backend.impl, isinstance(moe.experts.bank(), PackedMXFP4ExpertBank), self.device)
            saved.append((moe, moe.backend))
            moe.backend = LocalExperts(form, target)
        try:
            yield
        finally:
            for moe, backend in saved:
                moe.backend = backend

    def _forward(self, rows: int, pages: int) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            # a new batch object per run: what one run works out and keeps on the batch (fresh_seqs) must not reach
            # another, above all not from a warm-up run into the capture, where it would never be refilled
            batch = ForwardBatch(
                input_ids=self.input_ids[:rows],
                positions=self.positions[:rows],
                cu_seqlens=torch.arange(rows + 1, dtype=torch.int64, device=self.device),
                context_lens=self.context_lens[:rows],
                state_slots=self.state_slots[:rows],
                page_table=self.page_table[:rows, :pages],
                logits_indices=None,  # every row: a decode step samples every sequence
                is_decode=True,
                capturable=True,
            )
            with self._graph_experts():
                out = self.model(batch, self.cache.tensors)
            return self.logits[:rows].copy_(out)

        return forward

    def _captured(self, rows: int, pages: int) -> Captured:
        key = (rows, pages)
        if key not in self._graphs:
            self._pad(0, rows)  # the capture's runs write only to the scratch slot and page
            try:
                self._graphs[key] = self.capture(self._forward(rows, pages))
            except Exception as e:
                ops = dataclasses.asdict(self.model.ops)
                raise RuntimeError(
                    f"decode graph capture failed for batch {rows} x {pages} pages ({type(e).__name__}: {e}); the forward must read nothing "
                    f"back to the host and size nothing by the data (docs/gpu.md). The model's ops: {ops}"
                ) from e
        return self._graphs[key]

    def _pad(self, start: int, end: int) -> None:
        assert self.cache.scratch_slot is not None and self.cache.scratch_page is not None
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.context_lens[start:end] = 0
        self.state_slots[start:end] = self.cache.scratch_slot
        self.page_table[start:end] = self.cache.scratch_page

    def run(self, batch: ForwardBatch, bucket: tuple[int, int]) -> torch.Tensor:
        """The logits [n, V] of the decode step `batch` from `bucket` (bucket_for's answer), captured at first use."""
        assert batch.state_slots is not None and batch.page_table is not None
        assert self.cache.scratch_page is not None
        (rows, pages), n, width = bucket, batch.num_seqs, batch.page_table.shape[1]
        graph = self._captured(rows, pages)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.context_lens[:n].copy_(batch.context_lens)
        self.state_slots[:n].copy_(batch.state_slots)
        self.page_table[:n, :width].copy_(batch.page_table)
        # past a sequence's own pages nothing is read, but the masked-out rows are still multiplied by zero weights, so
        # they point at the scratch page rather than at whatever an earlier step left there
        self.page_table[:n, width:pages] = self.cache.scratch_page
        self._pad(n, rows)
        graph.replay()
        self.replays += 1
        return self.logits[:n]
