"""POST /v1/completions and POST /v1/chat/completions (behind the API key): read and check the body, build the engine jobs,
then stream SSE or answer JSON; a client that leaves before a JSON answer gets 499 and its requests are aborted.
The checks run in this order so that a bad body is a 4xx even while the engine is down: key, content type, body, model,
prompt, engine."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from openk3.api.jobs import chat_job, completion_jobs
from openk3.api.protocol import ChatCompletionRequest, CompletionRequest
from openk3.api.replies import chat_response, completion_response, open_chat_stream, open_completion_stream
from openk3.api.routes.schema import json_body
from openk3.api.routes.state import State, authorize, check_model, check_open, read_request
from openk3.api.routes.streams import EventStreamResponse, until_disconnect

router = APIRouter(dependencies=[Depends(authorize)])


def _json_or_gone(result: BaseModel | None) -> Response:
    return Response(status_code=499) if result is None else Response(result.model_dump_json(), media_type="application/json")


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, state: State) -> Response:
    served = state.served
    req = await read_request(request, state, CompletionRequest)
    check_model(state.config, req.model)
    jobs, texts = await completion_jobs(served, req)
    check_open(served)
    if req.stream:
        events, updates = await open_completion_stream(served, req, jobs, texts)
        return EventStreamResponse(events, updates.aclose)
    return _json_or_gone(await until_disconnect(request, completion_response(served, req, jobs, texts)))


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request, state: State) -> Response:
    served = state.served
    req = await read_request(request, state, ChatCompletionRequest)
    check_model(state.config, req.model)
    job = await chat_job(served, req)
    check_open(served)
    if req.stream:
        events, updates = await open_chat_stream(served, req, job)
        return EventStreamResponse(events, updates.aclose)
    return _json_or_gone(await until_disconnect(request, chat_response(served, req, job)))
