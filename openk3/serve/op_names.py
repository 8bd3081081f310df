"""EngineConfig.ops: implementations of the model's ops named for an engine, as vLLM's and SGLang's --attention-backend
and --moe-runner-backend name theirs: `openk3 serve --ops kda=fla,mla=triton,mla_decode=triton,moe=triton`,
`LLM(model, ops="kda=naive,moe=naive")` or `ops={"kda": "naive", "kda_chunk_size": 32}`.

Each pair sets one field of the model's OpChoice (model/model.py); the fields not named keep the model's own choice
(the checkpoint's `packed_experts` included, which cannot be named: it follows the weights), and "auto" is resolved
afterwards for the device the engine serves on, as without the setting (serve/prepare.py). Checked in three steps, so a
name that cannot run fails at start-up, never at the first request:
- parse_op_names, when the settings are made: a field OpChoice lacks, a malformed or repeated pair, a chunk size that is
  not a power of two;
- check_op_names, against the registry (ops/registry.py) for the device and dtype that run the names, and
  check_op_requirements, which imports the optional packages the named entries need (triton, fla): by the entry points
  that build the model, before its weights load (EngineConfig.check_ops_on_device), and when the engine prepares it;
- select_named_ops, on the model itself: one the names cannot apply to (not a K3ForCausalLM, in training mode, experts
  that run through a backend taking no name) is refused rather than left with a name unused.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, NoReturn

from torch import nn

from openk3.model.model import K3ForCausalLM, OpChoice
from openk3.model.moe import LocalExperts, SelectsExpertOps
from openk3.ops.registry import OpTarget, registry

# the registry op each named field selects (K3ForCausalLM.select_ops), in OpChoice's order
REGISTRY_OPS = {
    "kda": "kda_prefill",
    "conv": "short_conv",
    "mla": "mla_prefill",
    "mla_decode": "mla_decode",
    "moe": "moe_experts",
    "attn_res": "attn_res",
    "linear": "linear",
    "norm": "rms_norm",
    "route": "moe_route",
    "glu": "glu",
    "vision_attn": "vision_attn",
}
NUMBERS = ("kda_chunk_size",)  # fields that take an integer, not a name
NOT_NAMED = {"packed_experts": "it follows the checkpoint (packed MXFP4 experts or dense ones)"}
FIELDS = (*REGISTRY_OPS, *NUMBERS)
EXAMPLE = "kda=fla,mla=triton"

OpNames = dict[str, str | int]  # field -> implementation name (kda_chunk_size -> its integer)


def _fail(message: str) -> NoReturn:
    raise ValueError(f"EngineConfig.ops: {message}")


def parse_op_names(value: str | Mapping[str, Any] | None) -> OpNames:
    """The fields `value` names ("field=impl,..." or a dict), checked; {} for None or an empty string."""
    if value is None:
        return {}
    if isinstance(value, str):
        pairs = _pairs(value)
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        _fail(f"{value!r} is invalid: expected field=implementation pairs ({EXAMPLE}) or a dict of them")
    names: OpNames = {}
    for field, impl in pairs:
        if field in NOT_NAMED:
            _fail(f"{field} cannot be named: {NOT_NAMED[field]}")
        if field not in FIELDS:
            _fail(f"unknown field {field!r}: expected one of {', '.join(FIELDS)}")
        if field in names:
            _fail(f"{field} is named twice ({names[field]!r} and {impl!r})")
        names[field] = _number(field, impl) if field in NUMBERS else _name(field, impl)
    return names


def _pairs(text: str) -> list[tuple[str, str]]:
    if not text.strip():
        return []
    pairs = []
    for piece in text.split(","):
        field, eq, impl = (part.strip() for part in piece.partition("="))
        if not eq or not field or not impl or "=" in impl:
            where = "" if piece.strip() == text.strip() else f" in {text!r}"
            _fail(f"{piece.strip()!r}{where} is not a field=implementation pair (e.g. {EXAMPLE})")
        pairs.append((field, impl))
    return pairs


def _name(field: str, impl: Any) -> str:
    if not isinstance(impl, str) or not impl or any(c.isspace() or c in ",=" for c in impl):
        _fail(f"{field}={impl!r} is invalid: expected an implementation name (ops/registry.py lists them)")
    return impl


def _number(field: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"{field}={value!r} is invalid: expected an integer")
    checked: dict[str, Any] = {field: value}
    try:
        OpChoice(**checked)  # OpChoice's own rule (a power of two)
    except ValueError as e:
        _fail(str(e))
    return value


def format_op_names(names: Mapping[str, str | int]) -> str | None:
    """The canonical "field=impl,..." of `names` (OpChoice's field order), None when it names nothing."""
    return ",".join(f"{field}={names[field]}" for field in FIELDS if field in names) or None


def available_names(op: str, target: OpTarget) -> list[str]:
    """The implementation names of registry op `op` that can run on `target` ("auto" included)."""
    usable = []
    for name in registry().names(op):
        try:
            registry().entry(op, name, target)
        except ValueError:
            continue
        usable.append(name)
    return usable


def check_op_names(names: Mapping[str, str | int], target: OpTarget) -> None:
    """Refuse a name the registry lacks, or has only for other devices or dtypes than `target`'s, naming the field, the
    value and the names that can run there."""
    where = f"{target.device} {str(target.dtype).removeprefix('torch.')}"
    for field, impl in names.items():
        if field in NUMBERS:
            continue
        op = REGISTRY_OPS[field]
        usable = available_names(op, target)
        if impl in usable:
            continue
        why = f"cannot run on {where}" if impl in registry().names(op) else f"is not an implementation of {op}"
        _fail(f"{field}={impl!r} {why}: expected one of {', '.join(usable)} (on {where}; ops/registry.py lists them all)")


def check_op_requirements(names: Mapping[str, str | int], target: OpTarget) -> None:
    """Refuse a name whose optional dependency cannot be imported (triton, fla: the gpu extra), at start-up rather than at
    the first request, where the entry would import it. Run by the entry points that build the model on `target`."""
    for field, impl in names.items():
        if field in NUMBERS:
            continue
        for module in registry().entry(REGISTRY_OPS[field], str(impl), target)[1].requires:
            try:
                importlib.import_module(module)
            except ImportError as e:
                _fail(f"{field}={impl!r} needs {module.split('.')[0]}, which cannot be imported ({e}): pip install 'openk3[gpu]'")


def select_named_ops(model: nn.Module, names: Mapping[str, str | int], target: OpTarget) -> None:
    """Select `model`'s implementations with `names` set on its own OpChoice, "auto" resolved for `target` (they become
    the model's own: model.ops). Refuses a model the names cannot apply to, before changing anything."""
    shown = format_op_names(names)
    if not isinstance(model, K3ForCausalLM):
        _fail(f"{shown!r} names implementations of K3ForCausalLM's ops, but the engine's model is a {type(model).__name__}")
    if model.training:
        _fail(f"{shown!r}: the model is in training mode, which keeps the implementations its owner chose; give the engine a model in eval mode")
    check_op_names(names, target)
    check_op_requirements(names, target)
    if names.get("moe", "auto") != "auto":  # "auto" is what every backend runs without a name
        _check_expert_backends(model, str(names["moe"]))
        if names["moe"] == "triton" and not model.ops.packed_experts:  # the kernel reads E2M1 codes and E8M0 scales
            _fail("moe='triton' reads packed MXFP4 experts, and this model's experts are dense (a checkpoint without MXFP4 experts, or a preset)")
    named: dict[str, Any] = dict(names)
    model.select_ops(dataclasses.replace(model.ops, **named), target=target)


def _check_expert_backends(model: K3ForCausalLM, impl: str) -> None:
    """moe names the implementation of LocalExperts (or of a backend that selects one, SelectsExpertOps); select_ops
    keeps a name set on a LocalExperts itself, and other backends (expert parallelism) run a form of their own."""
    for moe in model.moe_layers():
        backend = moe.backend
        if isinstance(backend, LocalExperts) and backend.impl not in (model.ops.moe, impl):
            _fail(f"moe={impl!r}: the experts of layer {moe.layer_index} were given their own implementation {backend.impl!r}, which the model keeps")
        if not isinstance(backend, (LocalExperts, SelectsExpertOps)):
            _fail(f"moe={impl!r}: the experts of layer {moe.layer_index} run through {type(backend).__name__}, which takes no implementation name")
