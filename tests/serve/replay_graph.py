"""A CPU stand-in for CUDA graph capture, faithful where it matters: what a replay runs is what the capture recorded.

Capture runs the forward under a TorchDispatchMode that records every aten call with its tensor arguments by identity.
Replay calls the same ops again on the same tensors (the static input buffers, the parameters, the cache pools, and the
intermediates the capture made, like a graph's private memory pool) and copies each fresh result into the tensor the
capture produced, so later ops read this replay's values. Python-level decisions made during capture (a branch on a
value, a shape from the data, a constant built from the batch) are frozen into the recording exactly as a CUDA graph
freezes them: a forward that is not capture-safe replays the capture step's answer, and the check below catches it.

Refused during capture, as a CUDA capture would fail or silently freeze them: ops tagged data-dependent (`.item()`,
`torch.equal`, `bool(t)`, ...) or with data-dependent output shapes (nonzero, bincount, ...), and the Tensor methods that
read back without dispatching (tolist, numpy, cpu).

`checked=True`: every replay is also compared, bit for bit, with the same forward run eagerly on the same inputs and on
a copy of the cache state from before the replay (logits and every pool), so a frozen decision cannot hide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from openk3.model.batch import CacheTensors

READBACK_METHODS = ("tolist", "numpy", "cpu")


class CaptureError(RuntimeError):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self, calls: list[tuple[Any, tuple, dict, Any]]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch's signature
        kwargs = kwargs or {}
        if _sized_or_valued_by_data(func, args, kwargs):
            raise CaptureError(f"{func} during capture: a value or a size read from the data would be frozen into the graph")
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out if _makes_new_tensors(func, args, out) else None))
        return out


@contextlib.contextmanager
def _readbacks_refused() -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in READBACK_METHODS}

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise CaptureError(f"Tensor.{name}() during capture reads the tensor back to the host")

        return refused

    try:
        for name in READBACK_METHODS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _sized_or_valued_by_data(func: Any, args: tuple, kwargs: dict) -> bool:
    """torch's tags, refined where they cover two cases: indexing is sized by the data only with a boolean mask, and
    repeat_interleave only without output_size."""
    if torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


def _makes_new_tensors(func: Any, args: tuple, out: Any) -> bool:
    """Whether the op's results are new tensors the replay must refill. Views and in-place ops return (a view of) an
    argument, which the replay's call itself updates; an op that may alias (contiguous, reshape) is judged by what it did."""
    if not any(r.alias_info is not None for r in func._schema.returns):
        return True
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
    return not any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs for t in tree_leaves(out))


class ReplayGraph:
    def __init__(self, fn: Callable[[], torch.Tensor], calls: list[tuple[Any, tuple, dict, Any]], checked_cache: CacheTensors | None) -> None:
        self.fn, self.calls, self.checked_cache = fn, calls, checked_cache
        self.output: torch.Tensor | None = None
        self.replays = 0

    def _run_recording(self) -> None:
        for func, args, kwargs, out in self.calls:
            result = func(*args, **kwargs)
            if out is None:  # an alias of an argument
                continue
            for mine, fresh in zip(tree_leaves(out), tree_leaves(result), strict=True):
                if isinstance(mine, torch.Tensor):
                    if mine.shape != fresh.shape:
                        raise CaptureError(f"{func} made shape {tuple(fresh.shape)} on replay, {tuple(mine.shape)} at capture")
                    mine.copy_(fresh)

    def replay(self) -> None:
        self.replays += 1
        if self.checked_cache is None:
            self._run_recording()
            return
        pools = self.checked_cache.pools()
        before = [p.clone() for p in pools]
        self._run_recording()
        assert self.output is not None
        replayed, after = self.output.clone(), [p.clone() for p in pools]
        for pool, old in zip(pools, before, strict=True):
            pool.copy_(old)
        eager = self.fn()
        mismatched = [i for i, (pool, got) in enumerate(zip(pools, after, strict=True)) if not torch.equal(pool, got)]
        same_logits = torch.equal(eager, replayed)
        if not same_logits or mismatched:
            raise AssertionError(f"replay {self.replays} differs from the eager forward on the same inputs (logits equal: {same_logits}, pools {mismatched})")


class ReplayCapture:
    """A GraphCapture (serve/graphs.py) on CPU. `checked_cache`: compare every replay with the eager forward (docstring)."""

    def __init__(self, checked_cache: CacheTensors | None = None) -> None:
        self.checked_cache = checked_cache
        self.graphs: list[ReplayGraph] = []

    def __call__(self, fn: Callable[[], torch.Tensor]) -> ReplayGraph:
        fn()  # the warm-up run CudaGraphCapture makes before capturing: anything cached by it is not recorded
        calls: list[tuple[Any, tuple, dict, Any]] = []
        with _readbacks_refused(), _Recorder(calls):
            out = fn()
        graph = ReplayGraph(fn, calls, self.checked_cache)
        graph.output = out
        self.graphs.append(graph)
        return graph
