"""GET /server_info and GET /model_info (and SGLang's older names /get_server_info, /get_model_info): what sglang-router /
sgl-model-gateway reads from a worker when it registers it, so N x `openk3 serve` can sit behind it (docs/scale-out).

The gateway asks /server_info, then /get_server_info on a 404, for `model_path` and `served_model_name` (worker labels;
`model_path` is also where it loads a tokenizer from when none is configured) and, with --dp-aware only, `dp_size`; it asks
/model_info (then /get_model_info) for `model_type` and `architectures`. Older sglang-router releases ask only the get_
names. Unknown fields are ignored there, but a field of the wrong JSON type makes the whole answer unreadable, so each
value below has the type SGLang gives it. Every value is the running server's own; a field openk3 cannot honour is left
out, and the comment beside its absence says why. Outside /v1, so without the API key, like /health and /tokenize.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from openk3.api.errors import APIError
from openk3.api.routes.health import package_version
from openk3.api.routes.state import ServerState, State
from openk3.serve.loading import resolve_model

router = APIRouter()


def checkpoint_folder(model_root: str) -> Path | None:
    """The folder the served weights came from (a shipped preset's included), or None for a preset built from its seed."""
    try:
        folder = resolve_model(model_root)
    except ValueError as e:
        # the CLI loaded this very model, so only an app built by other code can get here: the server's fault, not the client's
        raise APIError(500, f"the server's model_root names no model: {e}", code="internal_error") from e
    return None if folder is None else folder.resolve()


def model_path(model_root: str) -> str:
    # the folder as an absolute path, which a router on the same host can load the tokenizer from; a preset built from its
    # seed has no folder, and its name is what --model was given
    folder = checkpoint_folder(model_root)
    return model_root if folder is None else str(folder)


def server_info(state: ServerState) -> dict[str, Any]:
    engine = state.served.frontend.engine
    cfg = engine.config
    return {
        "model_path": model_path(state.config.model.root),
        "served_model_name": state.config.model.name,
        "version": package_version(),
        "context_length": engine.max_model_len,
        # the running batch's bound (one KDA state slot each), over every data-parallel engine behind this server
        "max_running_requests": cfg.max_num_seqs * engine.num_engines,
        # MLA cache capacity in tokens (SGLang's KV pool size; every engine's); the KDA state is per request, bounded by
        # max_running_requests
        "max_total_tokens": engine.cache.num_pages * engine.cache.page_size * engine.num_engines,
        # openk3's step budget covers prefill and decode tokens together, so it also bounds the prefill tokens of one step
        "max_prefill_tokens": cfg.max_num_batched_tokens,
        "page_size": engine.cache.page_size,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        # SGLang's name for "neither a prefill nor a decode server": this server runs both phases of every request
        "disaggregation_mode": "null",
        # Left out: `dp_size` (and SGLang's `load_balance_method`): an openk3 server places requests on its data-parallel
        # engines itself (--dp) and does not accept the `data_parallel_rank` body field a --dp-aware router adds, so
        # without dp_size such a router refuses the worker at registration ("No dp_size in response") instead of every
        # request failing later. `tp_size`: the server is not told its parallel layout (expert-parallel ranks are driven
        # from outside the app). `max_batch_size`, `max_num_reqs`: openk3 has no quantity of that meaning beyond
        # max_running_requests above.
    }


def model_info(state: ServerState) -> dict[str, Any]:
    root = state.config.model.root
    out: dict[str, Any] = {"model_path": model_path(root), "is_generation": True, "max_context_length": state.served.frontend.engine.max_model_len}
    # Left out: `tokenizer_path`. The tokenizer object does not record its file (--tokenizer byte uses none), and the
    # gateway falls back to model_path for it, which is where openk3 reads the checkpoint's own tokenizer.
    folder = checkpoint_folder(root)
    if folder is not None:
        out.update(_checkpoint_identity(folder / "config.json"))
    # else a preset built from its seed: it has no config.json, so no model_type or architectures to report
    return out


def _checkpoint_identity(config_file: Path) -> dict[str, Any]:
    """`model_type` and `architectures` as the checkpoint's config.json states them (kimi_k3, kimi_linear, ...)."""
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:  # read at start-up, so it changed on disk since: report it, never a 4xx
        raise APIError(500, f"cannot read the checkpoint's {config_file}: {e}", code="internal_error") from e
    out: dict[str, Any] = {}
    if isinstance(raw.get("model_type"), str):
        out["model_type"] = raw["model_type"]
    architectures = raw.get("architectures")
    # the gateway reads a list of strings; anything else would void the whole answer, so it is left out
    if isinstance(architectures, list) and all(isinstance(a, str) for a in architectures):
        out["architectures"] = architectures
    return out


@router.get("/server_info")
@router.get("/get_server_info")  # the name sglang-router used before /server_info; the gateway still falls back to it
async def get_server_info(state: State) -> dict[str, Any]:
    return server_info(state)


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(state: State) -> dict[str, Any]:
    return model_info(state)
