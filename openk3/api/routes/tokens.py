"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's extensions, outside /v1 and so without the API key)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response

from openk3.api.chat import ChatOptions, ChatTemplate
from openk3.api.errors import APIError
from openk3.api.protocol import ChatMessage, DetokenizeRequest, TokenizeRequest
from openk3.api.routes.schema import json_body
from openk3.api.routes.state import State, check_model, read_request
from openk3.api.tool_schemas import check_tool_schemas
from openk3.api.user_text import PromptText, encode_prompt_text
from openk3.serve.tokenizer import Tokenizer

router = APIRouter()


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request, state: State) -> Response:
    served = state.served
    req = await read_request(request, state, TokenizeRequest)
    check_model(state.config, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", param="prompt", code="invalid_value")
    messages = req.messages
    if messages is None and (req.tools is not None or req.chat_template_kwargs is not None or req.reasoning_effort is not None):
        raise APIError(400, "tools, chat_template_kwargs and reasoning_effort go with messages, not prompt", param="prompt", code="invalid_value")
    tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools] or None
    options = ChatOptions(reasoning_effort=req.reasoning_effort)

    def render(messages: list[ChatMessage]) -> PromptText:
        check_tool_schemas(req.tools or ())
        if tools is not None and not served.chat_template.uses_tools:
            raise APIError(400, "tools are not supported for this model: its chat template does not render tools", param="tools", code="unsupported")
        return served.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs, tools, options)

    prompt = None if messages is None else await served.encoder.run(lambda: render(messages))
    # no size check: /tokenize answers how long a text is, even one too long to serve (the body limit bounds it)
    add_special = prompt is None if req.add_special_tokens is None else req.add_special_tokens

    if prompt is not None and prompt.cuts and add_special:
        message = "add_special_tokens=true is not supported with K3's encoding, which writes every special token itself (send it false)"
        raise APIError(400, message, param="add_special_tokens", code="unsupported")
    if prompt is not None and prompt.plain and add_special:
        message = "add_special_tokens=true with messages that hold special-token strings is not supported (send it false)"
        raise APIError(400, message, param="add_special_tokens", code="unsupported")

    def encode() -> list[int]:
        if prompt is None:
            return served.tokenizer.encode(req.prompt or "", add_special_tokens=add_special)
        if add_special:
            return served.tokenizer.encode(prompt.text, add_special_tokens=True)
        return encode_prompt_text(served.tokenizer, prompt)  # as the chat route: markers in messages stay text

    def answer() -> bytes:  # serialised here too: a 700k-id answer takes ~0.4 s through FastAPI's encoder on the event loop
        ids = encode()
        return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}).encode()

    return Response(await served.encoder.run(answer), media_type="application/json")


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request, state: State) -> dict:
    tokenizer = state.served.tokenizer
    req = await read_request(request, state, DetokenizeRequest)
    check_model(state.config, req.model)
    bad = next((t for t in req.tokens if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens has id {bad}: expected ids in 0..{tokenizer.vocab_size - 1}", param="tokens", code="invalid_value")
    # special tokens spelled out (vLLM's /detokenize does the same): a prompt from /tokenize reads back as it was rendered
    return {"prompt": await state.served.encoder.run(lambda: tokenizer.decode(req.tokens, skip_special_tokens=False))}


def _token_string(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict:
    """vLLM's GET /tokenizer_info: the tokenizer's special tokens, context length and chat template, what a client that
    tokenizes through this server needs (lm-evaluation-harness's `tokenizer_backend=remote`, chosen by its `local-
    completions` when this answers, so that scoring needs no tokenizer download)."""
    served = state.served
    tokenizer = served.tokenizer
    template = served.chat_template
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": _token_string(tokenizer, tokenizer.eos_token_id),
        "bos_token": _token_string(tokenizer, tokenizer.bos_token_id),
        "pad_token": None,
        "model_max_length": served.max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "chat_template": template.source if isinstance(template, ChatTemplate) else None,
    }
