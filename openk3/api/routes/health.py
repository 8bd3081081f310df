"""Unauthenticated probes: GET /health (200 with the engine's weight version, or 503 once the engine is down), GET /version, GET /metrics (Prometheus text)."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Response

from openk3.api.metrics import CONTENT_TYPE
from openk3.api.routes.state import State, check_open

router = APIRouter()


def package_version() -> str:
    try:
        return metadata.version("openk3")
    except metadata.PackageNotFoundError:
        return "unknown (openk3 is not installed as a package)"


@router.get("/health")
async def health(state: State) -> dict:
    check_open(state.served)
    return {"status": "ok", "weight_version": state.served.frontend.engine.weight_version}


@router.get("/version")
async def version() -> dict:
    return {"version": package_version()}


@router.get("/metrics")
async def prometheus(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
