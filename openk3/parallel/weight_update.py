"""New weights into a live engine in place, between steps, without rebuilding it: what `openk3.rl.weight_sync` (in process)
and the server's weight routes (api/routes/weights.py: from a folder, over a trainer's group) share.

1. The tensors are named as the served model names its parameters and buffers, after `served_tensors` maps the other
   accepted spellings: the official checkpoint names (model/weights.py canonical_name, routed experts one tensor per
   expert, stacked here; A_log as transformers or the release shape it; a folder is read without the release's extras),
   and full-precision experts (stacked `experts.w1` or per expert `experts.{e}.w1.weight`) for a model that serves packed
   MXFP4 experts, which are quantised on the way in exactly as `K3ForCausalLM.quantize_experts` quantises offline
   (ops/mxfp4.py, FLOOR scales, one expert at a time).
2. Every name and shape is checked before anything is written (a partial update of the tensors a trainer changed is fine).
3. Each tensor is copied in place (`copy_`), so the fused blocks the parameters are views of see the new values; oneDNN's
   packed CPU copies are dropped and the serving layout applied again (parallel/layout.py), as at build time.
4. The engine rekeys its prefix cache by the new weights' salt and counts a new weight version (LLMEngine.weights_changed).

The engine must be idle: the caller pauses it (LLM between two generate calls; the server's AsyncEngine.call_idle).
One process only: an engine whose model is a driver of other ranks (--tp / --ep) or a data-parallel engine is refused by
`check_updatable`, which names what is missing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from openk3.config.hf import mtp_layer_count
from openk3.model.checkpoint import EXPERT_RE, STACKED_SUFFIX, canonical_name, checkpoint_names, iter_checkpoint
from openk3.model.model import K3ForCausalLM
from openk3.model.release import fit_a_log, release_extras
from openk3.ops.mxfp4 import quantize
from openk3.parallel.layout import ServingPlan, apply_serving_layout
from openk3.serve.engine import LLMEngine
from openk3.serve.engine_api import ServedEngine

STACKED_DENSE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")


class WeightUpdateError(ValueError):
    """An update this engine cannot take (a name, a shape, a layout); nothing was written."""


def check_updatable(engine: ServedEngine) -> LLMEngine:
    """The single-process engine behind `engine`, or a WeightUpdateError naming why its weights cannot be replaced here."""
    if not isinstance(engine, LLMEngine):
        raise WeightUpdateError(
            f"weight updates: a {type(engine).__name__} (data-parallel ranks) is not supported; each rank's engine would need the "
            "update, and the rank protocol (parallel/serving/step_channel.py) has no message that carries weights (issue 40)"
        )
    if not isinstance(engine.model, torch.nn.Module):
        raise WeightUpdateError(
            f"weight updates: this engine's model is a {type(engine.model).__name__} that drives other ranks (--tp / --ep); "
            "their weights live in the rank processes, and the rank protocol (parallel/serving/step_channel.py) has no message "
            "that carries weights to them (issue 40)"
        )
    return engine


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def _quantized(prefix: str, w: str, dense_EIJ: torch.Tensor) -> dict[str, torch.Tensor]:
    e, rows, cols = dense_EIJ.shape
    packed = torch.empty(e, rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(e, rows, cols // 32, dtype=torch.uint8)
    for i in range(e):  # one expert at a time, as PackedExperts.from_dense
        packed[i], scales[i] = quantize(dense_EIJ[i].detach().float().cpu())
    return {f"{prefix}.{w}_weight_packed": packed, f"{prefix}.{w}_weight_scale": scales}


def _stacked(key: str, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    missing = sorted(set(range(max(rows) + 1)) - set(rows))
    if missing:
        raise WeightUpdateError(f"weight update: {key} is given for experts {sorted(rows)} but not {missing[:8]}: send every expert of a bank")
    return torch.stack([rows[e] for e in range(len(rows))])


def served_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` under the served model's own state-dict names (module docstring, step 1)."""
    targets = _targets(model)
    config = model.config if isinstance(model, K3ForCausalLM) else None
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for raw, tensor in tensors.items():
        name = canonical_name(raw, config) if config is not None else raw
        m = EXPERT_RE.match(name)
        if m and m.group(4) in STACKED_SUFFIX:
            key = f"{m.group(1)}.{m.group(3)}{STACKED_SUFFIX[m.group(4)]}"
            if m.group(4) == "weight_blocks":  # gpt-oss [rows, K/32, 16] -> [rows, K/2], the same nibble order
                tensor = tensor.reshape(tensor.shape[0], -1)
            per_expert.setdefault(key, {})[int(m.group(2))] = tensor
        else:
            out[name] = tensor
    for key, rows in per_expert.items():
        out[key] = _stacked(key, rows)
    for name in list(out):
        target = targets.get(name)
        if name.endswith("self_attn.A_log") and target is not None and tuple(out[name].shape) != tuple(target.shape):
            fitted, problem = fit_a_log(name, out[name], target)  # transformers' [1, 1, H, 1] or the release's zero padding
            if problem is None:
                out[name] = fitted
        dense = STACKED_DENSE.match(name)
        if dense and name not in targets and f"{name}_weight_packed" in targets:
            out.update(_quantized(dense.group(1), dense.group(2), out.pop(name)))
        elif out[name].dtype in (torch.int8, torch.float8_e8m0fnu) and name.endswith(("_weight_packed", "_weight_scale")):
            out[name] = out[name].view(torch.uint8)  # packed codes and E8M0 scales are raw bytes whatever the sender calls them
    return out


def folder_tensors(folder: Path, model: object) -> dict[str, torch.Tensor]:
    """A checkpoint folder's tensors for an update of `model`, without the release's extras that are no part of the
    model (model/release.py: multi-token-prediction layers), as load_model skips them."""
    extras: set[str] = set()
    if isinstance(model, K3ForCausalLM) and (folder / "config.json").exists():
        extras = set(release_extras(checkpoint_names(folder), model.config, mtp_layer_count(folder)))
    return dict(iter_checkpoint(folder, keep=lambda name: name not in extras))


def check_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise a WeightUpdateError naming every tensor the model has no place for (unknown name, other shape)."""
    targets = _targets(model)
    problems = []
    for name, value in tensors.items():
        target = targets.get(name)
        if target is None:
            problems.append(f"{name!r} is not a parameter or buffer of the served model")
        elif tuple(value.shape) != tuple(target.shape):
            problems.append(f"{name!r} has shape {tuple(value.shape)}, the served model's is {tuple(target.shape)}")
    if problems:
        raise WeightUpdateError("weight update refused, nothing written:\n  " + "\n  ".join(problems))


def _drop_packed_copies(model: torch.nn.Module) -> None:
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None and hasattr(packed, "reset"):
            packed.reset()
        block = getattr(module, "block", None)
        if block is not None and hasattr(block, "packed"):
            block.packed.reset()


def update_engine_weights(served: ServedEngine, tensors: Mapping[str, torch.Tensor]) -> int:
    """Load `tensors` into the idle engine in place (module docstring); returns the engine's new weight version."""
    engine = check_updatable(served)
    model = engine.model
    assert isinstance(model, torch.nn.Module)
    if engine.has_unfinished():
        raise RuntimeError("weight update: requests are running; pause the engine (or update between rollouts)")
    named = served_tensors(model, tensors)
    check_tensors(model, named)
    targets = _targets(model)
    with torch.no_grad():
        for name, value in named.items():
            targets[name].copy_(value)
    _drop_packed_copies(model)
    config = engine.config
    apply_serving_layout(model, ServingPlan(engine.device, ops=config.op_names, pack_cpu_weights=config.pack_cpu_weights is True))
    return engine.weights_changed()
