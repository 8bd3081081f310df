"""GET /health_generate: 200 only once a 1-token generation has gone through the engine (admission, a scheduled step, the
model, the sampler, the output path), 503 with the reason otherwise, within HEALTH_GENERATE_TIMEOUT_S.

/health says the engine thread is alive and no step has stalled; this says it still produces tokens, which is what
sglang-router's health checker asks when pointed here (`--health-check-endpoint /health_generate`). Unlike SGLang, a busy
server is not taken as healthy: every probe runs its own generation, so under load it queues like any request and a full
queue answers 503 (the router should then send elsewhere). The probe is a real request and shows in the metrics. Outside
/v1, so without the API key, like /health.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import APIRouter, Request, Response

from openk3.api.errors import APIError, frontend_error
from openk3.api.routes.state import State, check_open
from openk3.api.routes.streams import until_disconnect
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.output_types import OutputKind, RequestOutput
from openk3.serve.sampling import SamplingParams

router = APIRouter()
log = logging.getLogger("openk3.api")

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default for the same probe (HEALTH_CHECK_TIMEOUT)
PROMPT = [0]  # any id the model has: the probe checks that tokens come out, not what they are (SGLang also sends [0])
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # exactly one token, whatever the model emits


async def _one_token(frontend: AsyncEngine) -> RequestOutput:
    stream = await frontend.add(f"health_generate-{uuid.uuid4().hex}", PROMPT, PARAMS, OutputKind.FINAL_ONLY)
    final = None
    try:
        async for output in stream:
            final = output
    finally:
        await stream.aclose()  # on a timeout or a client that left, this aborts the request and frees its page and slot
    if final is None:
        raise RuntimeError("the request ended without an output")
    return final


@router.get("/health_generate")
async def health_generate(request: Request, state: State) -> Response:
    check_open(state.served)  # a dead or stalled engine answers at once, without a request waiting on it
    frontend = state.served.frontend
    try:
        final = await until_disconnect(request, asyncio.wait_for(_one_token(frontend), HEALTH_GENERATE_TIMEOUT_S))
    except asyncio.TimeoutError as e:
        raise APIError(503, f"the engine produced no token within {HEALTH_GENERATE_TIMEOUT_S:g} s", code="unavailable") from e
    except Exception as e:
        known = frontend_error(e)  # overloaded, shutting down, or the engine loop failed
        if known is not None:
            raise known from e
        # anything else is the engine failing to generate: that is the answer this probe exists to give, so it is a 503
        log.exception("/health_generate: the 1-token generation failed", exc_info=e)
        raise APIError(503, f"the 1-token generation failed: {type(e).__name__}: {e}", code="unavailable") from e
    if final is None:
        return Response(status_code=499)  # the prober left; its request was aborted
    sample = final.outputs[0]
    if len(sample.token_ids) != 1:
        raise APIError(503, f"the 1-token generation ended with {len(sample.token_ids)} tokens ({sample.finish_reason})", code="unavailable")
    return Response(status_code=200)
