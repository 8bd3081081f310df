"""GET /v1/models: the one model this server serves (behind the API key, like every /v1 route)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from openk3.api.protocol import ModelCard, ModelList
from openk3.api.routes.state import State, authorize

router = APIRouter(dependencies=[Depends(authorize)])


@router.get("/v1/models")
async def models(state: State) -> Response:
    config = state.config
    card = ModelCard(id=config.model_name, root=config.model_root, max_model_len=state.served.max_model_len)
    return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")
