"""What a request asks its output to match (`StructuredOutputs`, vLLM's names), and the compiled form the sampler uses (`Grammar`).

One kind per request: a JSON schema (`json`), any JSON object (`json_object`), a regular expression (`regex`), one of a
few strings (`choice`), an EBNF grammar in xgrammar's syntax (`grammar`, GBNF-style: `root ::= ...`), or an xgrammar
structural tag (`structural_tag`, as JSON text: what tool calls compile to, api/tool_choice.py). Texts are stored as they
will be compiled, so a spec is its own cache key. `Grammar` is a compiled spec for one vocabulary: it is built where the
request is (api/jobs.py through api/structured_request.py, off the engine thread) and rides in SamplingParams; the sampler only applies it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None  # a JSON schema as JSON text (a dict is dumped, its key order kept)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # JSON text
    any_whitespace: bool = False  # JSON kinds: allow any whitespace between tokens (default: compact, `", "` and `": "`)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", dump_json(self.json))
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            object.__setattr__(self, "structural_tag", dump_json(self.structural_tag))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputs: exactly one of {', '.join(KINDS)} must be set, got {given or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"StructuredOutputs.choice={self.choice!r} is invalid: expected a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputs.{name}={value!r} is invalid: expected a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def dump_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # key order kept: it is the order generated


@dataclass(frozen=True)
class Grammar:
    """A compiled `StructuredOutputs` for a vocabulary of `vocab_size` ids (the model's logits width). Equal when the spec is."""

    spec: StructuredOutputs
    vocab_size: int
    compiled: Any = field(compare=False, repr=False)  # xgrammar.CompiledGrammar
