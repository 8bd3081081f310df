"""The request bodies in /openapi.json. The routes read their bodies by hand (api/errors.py: size, deadline, UTF-8, JSON and
schema each get their own 4xx), so FastAPI does not see them; each POST route declares its pydantic model here instead."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_DEFS = "#/$defs/"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`: the model's JSON schema with its `$defs` inlined (a schema
    inside an OpenAPI document cannot refer to `#/$defs/...`, which would resolve against the document's root)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise ValueError(f"json_body({model.__name__}): the schema nests deeper than 32 levels (a recursive model?)")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(_DEFS):
                return inline(defs[ref[len(_DEFS) :]], depth + 1)
            out = {k: inline(v, depth + 1) for k, v in node.items()}
            if isinstance(out.get("discriminator"), dict):
                # its mapping names $defs entries, which are inlined now; the property name alone still picks the branch
                out["discriminator"] = {k: v for k, v in out["discriminator"].items() if k != "mapping"}
            return out
        if isinstance(node, list):
            return [inline(v, depth + 1) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
