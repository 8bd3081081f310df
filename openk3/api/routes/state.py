"""What every route shares: the server's config, the served model and metrics (one `ServerState` on `app.state`), reached
through FastAPI dependencies instead of closures, and the checks the routes run (API key, model name, engine alive)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel

from openk3.api.connection import ConnectionConfig
from openk3.api.errors import RESTART_RETRY_AFTER_S, RETRY_AFTER_S, APIError, read_json
from openk3.api.limits import RequestLimits
from openk3.api.media_fetch import MediaFetchConfig
from openk3.api.metrics import PREFIX as METRICS_PREFIX
from openk3.api.metrics import ServerMetrics
from openk3.api.responses_store import DEFAULT_CAPACITY
from openk3.api.served_model import ModelIdentity, ServedModel
from openk3.options import check_settings, setting
from openk3.serve.config import FrontendConfig
from openk3.serve.vision_processor import MediaConfig

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class WeightUpdateConfig:
    """What the operator allows of the weight routes (routes/weights.py); off by default, as an update replaces the model
    every answer comes from."""

    weight_update_root: str | None = setting(None, "allow POST /update_weights_from_disk for safetensors folders under this directory (default: off)")
    weight_update_group: bool = setting(False, "allow POST /init_weights_update_group: a trainer's gloo group sends weights (default: off)")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings (create_app's): which model it answers as, and what the HTTP side allows."""

    model: ModelIdentity
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20  # a 10 MB body is refused with 413 before it is read
    shutdown_timeout_s: float = 30.0
    frontend: FrontendConfig = field(default_factory=FrontendConfig)  # admission: waiting-queue bound and timeout
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)  # body deadline and CORS (and uvicorn's bounds, for the CLI)
    response_store_size: int = DEFAULT_CAPACITY  # responses kept for previous_response_id (api/responses_store.py)
    heap_trim_slack_bytes: int | None = None  # trim the C heap when idle this far above the start-up RSS (serve/heap_trim.py)
    default_chat_template_kwargs: dict = field(default_factory=dict)  # --default-chat-template-kwargs: under each request's own
    metrics_prefix: str = METRICS_PREFIX  # --metrics-prefix: the engine's metric names on /metrics (api/metrics.py)
    media: MediaConfig | None = None  # preprocessor_config.json's media_proc_cfg (None: K3's release values), for image input
    media_fetch: MediaFetchConfig = field(default_factory=MediaFetchConfig)  # hosts image URLs may be fetched from (default none)
    weight_updates: WeightUpdateConfig = field(default_factory=WeightUpdateConfig)  # the weight routes the operator allows


@dataclass(frozen=True)
class ServerState:
    """Fixed for the app's lifetime; create_app stores it as `app.state.server`."""

    config: ServerConfig
    served: ServedModel
    metrics: ServerMetrics


# Dependencies are async so that FastAPI runs them on the event loop rather than hopping to its thread pool per request.
async def server_state(request: Request) -> ServerState:
    state = request.app.state.server
    assert isinstance(state, ServerState), "the app was not built by openk3.api.server.create_app"
    return state


State = Annotated[ServerState, Depends(server_state)]


async def authorize(request: Request, state: State) -> None:
    """The /v1 routes' API-key check (as vLLM checks /v1 only); a no-op when the server has no key."""
    key = state.config.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")


async def read_request(request: Request, state: ServerState, model: type[M]) -> M:
    """The request's JSON body as `model`, within the server's size limit and body deadline (api/errors.py read_json)."""
    return await read_json(request, model, state.config.max_body_bytes, state.config.connection.body_read_timeout_s)


def check_model(config: ServerConfig, name: str | None) -> None:
    if name is not None and name != config.model.name:
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{config.model.name}`.", param="model", code="model_not_found")


def check_open(served: ServedModel) -> None:
    frontend = served.frontend
    if not frontend.is_healthy:
        stalled = frontend.stalled_for()
        if frontend.error is not None:
            message = f"the engine failed: {frontend.error!r}"
        elif stalled is not None:
            message = f"the engine's current step has run for {stalled:.0f} s, longer than --step-timeout-s {frontend.config.step_timeout_s:g}"
        else:
            message = "the engine is not running"
        if frontend.error is None and stalled is not None:  # the step may yet end: come back soon
            raise APIError(503, message, code="engine_stalled", headers={"Retry-After": str(RETRY_AFTER_S)})
        raise APIError(503, message, code="unavailable", headers={"Retry-After": str(RESTART_RETRY_AFTER_S)})
