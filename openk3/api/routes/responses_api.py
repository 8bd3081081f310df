"""The Responses API's routes (behind the API key): POST /v1/responses, OpenAI's Responses API on the chat path
(api/responses_run.py), and over the bounded store (api/responses_store.py) GET /v1/responses/{id}, DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items. The POST's checks run in the chat route's order, so that a bad
body is a 4xx even while the engine is down: key, content type, body, model, previous_response_id, prompt, engine.
An unknown, deleted or evicted id is a 404 with an OpenAI error body saying which."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from openk3.api.errors import APIError
from openk3.api.responses_request import ResponsesRequest
from openk3.api.responses_run import open_response_stream, response_job, whole_response
from openk3.api.responses_store import ResponseStore
from openk3.api.routes.schema import json_body
from openk3.api.routes.state import State, authorize, check_model, check_open, read_request
from openk3.api.routes.streams import EventStreamResponse, until_disconnect

router = APIRouter(dependencies=[Depends(authorize)])


def response_store(request: Request) -> ResponseStore:
    store = request.app.state.response_store
    assert isinstance(store, ResponseStore), "the app was not built by openk3.api.server.create_app"
    return store


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
async def responses(request: Request, state: State) -> Response:
    served = state.served
    req = await read_request(request, state, ResponsesRequest)
    check_model(state.config, req.model)
    store = response_store(request)
    job = await response_job(served, req, store)
    check_open(served)
    if req.stream:
        events, updates = await open_response_stream(served, job, store)
        return EventStreamResponse(events, updates.aclose)
    result = await until_disconnect(request, whole_response(served, job, store))
    return Response(status_code=499) if result is None else Response(result.model_dump_json(), media_type="application/json")


def _no_include(include: list[str] | None) -> None:
    if include:
        raise APIError(400, f"include={include!r} is not supported: openk3 adds nothing optional to a response", param="include", code="invalid_value")


@router.get("/v1/responses/{response_id}")
async def retrieve(request: Request, response_id: str, include: Annotated[list[str] | None, Query()] = None, stream: bool = False) -> JSONResponse:
    _no_include(include)
    if stream:
        raise APIError(400, "stream=true is not supported: a stored response is returned whole", param="stream", code="invalid_value")
    return JSONResponse(response_store(request).get(response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete(request: Request, response_id: str) -> JSONResponse:
    response_store(request).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    request: Request,
    response_id: str,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,
) -> JSONResponse:
    """The items the response's request sent (not the earlier turns of its previous_response_id), OpenAI's list page:
    newest first unless order=asc, `limit` of them after the item `after`."""
    _no_include(include)
    items = list(response_store(request).get(response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after={after!r} is not an input item of response {response_id!r}", param="after", code="invalid_value")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
    return JSONResponse({"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(items) > limit})
