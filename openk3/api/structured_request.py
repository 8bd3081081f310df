"""Structured output a request asks for: `structured_request` reads the one field that asks for it (response_format,
structured_outputs or a guided_* field) and `compile_structured` compiles it (on a worker thread, cached per spec), a spec
the grammar engine refuses being a 400 naming that field."""

from __future__ import annotations

from dataclasses import dataclass

from openk3.api.errors import APIError
from openk3.api.protocol import ChatCompletionRequest, _SamplingFields
from openk3.serve.structured.compiler import GrammarCompiler, GrammarError
from openk3.serve.structured.spec import Grammar, StructuredOutputs


@dataclass(frozen=True)
class StructuredRequest:
    param: str  # the request field that asked for it
    spec: StructuredOutputs


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _spec(param: str, **fields: object) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)  # type: ignore[arg-type]
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from e


def structured_request(req: _SamplingFields) -> StructuredRequest | None:
    """The structured output a request asks for, or None; two fields asking for it at once are a 400."""
    rf = req.response_format if isinstance(req, ChatCompletionRequest) else None  # legacy completions have none
    asked = [name for name in ("response_format", "structured_outputs", *GUIDED) if getattr(req, name, None) is not None]
    if rf is not None and rf.type == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} both ask for structured output: send one of them", param=asked[1], code="invalid_value")
    if not asked:
        return None
    param = asked[0]
    if rf is not None and param == "response_format":
        if rf.type == "json_object":
            return StructuredRequest(param, _spec(param, json_object=True))
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema is required when type is 'json_schema'", param=param, code="invalid_value")
        schema = rf.json_schema.schema_
        return StructuredRequest(param, _spec(param, json_object=True) if schema is None else _spec(param, json=schema))
    so = req.structured_outputs
    if so is not None:
        whitespace = so.disable_any_whitespace is False
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar, "json_object": bool(so.json_object)}
        fields["structural_tag"] = so.structural_tag
        return StructuredRequest(param, _spec(param, any_whitespace=whitespace, **fields))
    value = getattr(req, param)
    return StructuredRequest(param, _spec(param, **{param.removeprefix("guided_"): value}))


def compile_structured(compiler: GrammarCompiler, asked: StructuredRequest) -> Grammar:
    """Blocking (milliseconds for ordinary schemas, more for big ones): call it on a worker thread."""
    try:
        return compiler.compile(asked.spec)
    except GrammarError as e:
        raise APIError(400, f"{asked.param} ({e.field}) {e.reason}", param=asked.param, code="invalid_value") from e
