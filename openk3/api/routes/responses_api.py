"""POST /v1/responses (behind the API key): OpenAI's Responses API on the chat path (api/responses_run.py). The checks run
in the chat route's order, so that a bad body is a 4xx even while the engine is down: key, content type, body, model,
previous_response_id, prompt, engine."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

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
