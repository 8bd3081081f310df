"""Compiling structured-output specs for one vocabulary, each spec once.

`GrammarCompiler` wraps xgrammar's compiler over the tokenizer's `TokenizerInfo` (serve/structured/vocab.py) and keeps the
last `cache_size` compiled grammars by spec, so a schema sent with every request is compiled on its first request only
(xgrammar also caches by grammar text underneath). Compiling costs milliseconds for ordinary schemas but is unbounded for
big ones, so callers compile where the request is built, on a worker thread, never on the engine's step (api/structured_request.py).
A spec that cannot be compiled raises `GrammarError`, a ValueError that names the spec's field.
Thread-safe: the cache is locked; xgrammar's compiler is safe to call from several threads.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from openk3.serve.structured.spec import Grammar, StructuredOutputs, dump_json
from openk3.serve.structured.vocab import token_info
from openk3.serve.tokenizer import Tokenizer

_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] /path/file.cc:123: " before the message


class GrammarError(ValueError):
    """A spec the grammar engine refuses; `field` is the StructuredOutputs field that holds it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def _engine_message(e: Exception) -> str:
    lines = [_ENGINE_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return next((line for line in lines if line), type(e).__name__)


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256, max_threads: int = 2, markup: frozenset[str] = frozenset()) -> None:
        """`markup`: special tokens its grammars may write as the marker text they stand for (serve/structured/vocab.py)."""
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = token_info(tokenizer, vocab_size, markup)
        self._xgr = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True)
        self._cache: OrderedDict[StructuredOutputs, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def compile(self, spec: StructuredOutputs) -> Grammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = Grammar(spec, self.vocab_size, self._compile(spec))
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutputs) -> Any:
        kind = spec.kind
        try:
            if spec.json is not None:
                schema = json.loads(spec.json)
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(kind, f"a JSON schema is an object (or a boolean), not {type(schema).__name__}")
                return self._xgr.compile_json_schema(spec.json, any_whitespace=spec.any_whitespace, strict_mode=True)
            if spec.json_object:
                return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace, strict_mode=False)
            if spec.regex is not None:
                return self._xgr.compile_regex(spec.regex)
            if spec.choice is not None:
                options = [{"type": "const_string", "value": c} for c in spec.choice]
                tag = {"type": "structural_tag", "format": {"type": "or", "elements": options}}
                return self._xgr.compile_structural_tag(dump_json(tag))
            if spec.grammar is not None:
                return self._xgr.compile_grammar(spec.grammar)
            assert spec.structural_tag is not None
            return self._xgr.compile_structural_tag(spec.structural_tag)
        except GrammarError:
            raise
        except json.JSONDecodeError as e:
            raise GrammarError(kind, f"not valid JSON ({e})") from e
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors (InvalidJSONError is a RuntimeError)
            raise GrammarError(kind, f"cannot be compiled: {_engine_message(e)}") from e
