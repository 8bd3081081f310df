"""Weight updates over HTTP for RL trainers (SGLang's names): POST /update_weights_from_disk (a safetensors folder under the
operator's --weight-update-root), POST /init_weights_update_group + /update_weights_from_distributed +
/destroy_weights_update_group (a gloo group with the trainer as rank 0, parallel/weight_group.py), GET /get_weight_version.

Every update pauses the engine (AsyncEngine.call_idle): new requests wait, the requests in flight finish on the old weights
(or, with `abort_running`, are aborted: finish_reason "abort"), the tensors are copied in (parallel/weight_update.py: names
mapped, dense experts quantised for an MXFP4 engine, prefix cache rekeyed, version counted), and the requests that waited
run on the new weights. Reading the folder or receiving from the group happens before the pause, while the engine decodes.
The routes are off unless the operator allows them, and need the API key when the server has one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from openk3.api.errors import APIError
from openk3.api.routes.state import State, WeightUpdateConfig, authorize, check_open, read_request
from openk3.parallel.weight_group import TensorSpec, WeightGroup
from openk3.parallel.weight_update import check_updatable, folder_tensors, update_engine_weights

router = APIRouter(dependencies=[Depends(authorize)])


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not read is an error, not ignored


class FromDisk(_Body):
    model_path: str
    abort_running: bool = False  # abort the requests in flight instead of letting them finish on the old weights


class InitGroup(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1)  # this server's rank in the group (the trainer is rank 0)
    world_size: int = Field(ge=2)
    backend: str = "gloo"
    group_name: str = "weight_update_group"
    timeout_s: float = Field(default=300.0, gt=0)


class FromGroup(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    abort_running: bool = False


class GroupName(_Body):
    group_name: str = "weight_update_group"


def _groups(request: Request) -> dict[str, WeightGroup]:
    """The weight groups this server has joined, by name (create_app makes the dict)."""
    groups = request.app.state.weight_groups
    assert isinstance(groups, dict), "the app was not built by openk3.api.server.create_app"
    return groups


def _config(state: State) -> WeightUpdateConfig:
    return state.config.weight_updates


async def _apply(state: State, tensors: dict[str, torch.Tensor], abort_running: bool) -> dict:
    version = await state.served.frontend.call_idle(lambda engine: update_engine_weights(engine, tensors), abort_running)
    return {"success": True, "message": f"{len(tensors)} tensors loaded", "weight_version": version}


def _allowed_folder(root: str | None, path: str) -> Path:
    if root is None:
        raise APIError(403, "weight updates from disk are off: start the server with --weight-update-root DIR", code="forbidden")
    folder = Path(path).resolve()  # symlinks and '..' resolved before the check
    base = Path(root).resolve()
    if not folder.is_relative_to(base):
        raise APIError(403, f"model_path {path!r} is outside --weight-update-root {root!r}", param="model_path", code="forbidden")
    if not folder.is_dir():
        raise APIError(400, f"model_path {path!r} is not a folder", param="model_path", code="invalid_value")
    return folder


@router.post("/update_weights_from_disk")
async def from_disk(request: Request, state: State) -> dict:
    body = await read_request(request, state, FromDisk)
    check_open(state.served)
    folder = _allowed_folder(_config(state).weight_update_root, body.model_path)
    engine = check_updatable(state.served.frontend.engine)
    tensors = await asyncio.to_thread(folder_tensors, folder, engine.model)
    return await _apply(state, tensors, body.abort_running)


@router.post("/init_weights_update_group")
async def init_group(request: Request, state: State) -> dict:
    body = await read_request(request, state, InitGroup)
    if not _config(state).weight_update_group:
        raise APIError(403, "weight updates over a group are off: start the server with --weight-update-group", code="forbidden")
    if body.backend != "gloo":
        raise APIError(400, f"backend {body.backend!r}: only 'gloo' is supported", param="backend", code="invalid_value")
    if body.rank_offset >= body.world_size:
        raise APIError(400, f"rank_offset {body.rank_offset} must be below world_size {body.world_size}", param="rank_offset", code="invalid_value")
    check_updatable(state.served.frontend.engine)
    groups = _groups(request)
    if body.group_name in groups:
        raise APIError(409, f"weight group {body.group_name!r} is already open: destroy it first", param="group_name", code="conflict")
    group = await asyncio.to_thread(WeightGroup, body.master_address, body.master_port, body.rank_offset, body.world_size, body.timeout_s)
    groups[body.group_name] = group
    return {"success": True, "message": f"joined {body.group_name!r} as rank {body.rank_offset} of {body.world_size}"}


@router.post("/update_weights_from_distributed")
async def from_group(request: Request, state: State) -> dict:
    body = await read_request(request, state, FromGroup)
    check_open(state.served)
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise APIError(400, f"{len(body.names)} names, {len(body.dtypes)} dtypes and {len(body.shapes)} shapes: one each per tensor", code="invalid_value")
    specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(body.names, body.dtypes, body.shapes, strict=True)]
    groups = _groups(request)
    if len(groups) != 1:
        raise APIError(400, f"{len(groups)} weight groups are open; open exactly one with /init_weights_update_group", code="invalid_value")
    (group,) = groups.values()
    tensors = await asyncio.to_thread(group.receive, specs)
    return await _apply(state, tensors, body.abort_running)


@router.post("/destroy_weights_update_group")
async def destroy_group(request: Request, state: State) -> dict:
    body = await read_request(request, state, GroupName)
    group = _groups(request).pop(body.group_name, None)
    if group is None:
        raise APIError(404, f"no weight group {body.group_name!r} is open", param="group_name", code="not_found")
    group.close()
    return {"success": True, "message": f"left {body.group_name!r}"}


@router.get("/get_weight_version")
async def weight_version(state: State) -> dict:
    return {"weight_version": state.served.frontend.engine.weight_version}
