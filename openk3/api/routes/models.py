"""GET /v1/models and GET /v1/models/{id}: the one model this server serves (behind the API key, like every /v1 route)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from openk3.api.responses import ModelCard, ModelList
from openk3.api.routes.state import State, authorize, check_model

router = APIRouter(dependencies=[Depends(authorize)])


def _card(state: State) -> ModelCard:
    config = state.config
    return ModelCard(id=config.model.name, root=config.model.root, max_model_len=state.served.max_model_len)


@router.get("/v1/models", response_model=ModelList)
async def models(state: State) -> Response:
    return Response(ModelList(data=[_card(state)]).model_dump_json(), media_type="application/json")


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)  # :path, as served names often hold a '/' (org/model)
async def model(model_id: str, state: State) -> Response:
    check_model(state.config, model_id)
    return Response(_card(state).model_dump_json(), media_type="application/json")
