"""A checkpoint's `generation_config.json`, read as vLLM's `--generation-config auto` reads it: its `eos_token_id` (an id or a
list) ends every generation, as the tokenizer's eos does, whatever tokenizer serves the model; its sampling values
(`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` as max_tokens) are the defaults of a
request that does not set them. Every other key is skipped, and `log` says which were read and which skipped, and why:
`do_sample` in particular is not read (vLLM does not read it either; a request's temperature decides)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE = "generation_config.json"
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
SAMPLING_KEYS["max_new_tokens"] = "max_tokens"
_SKIP_WHY = {
    "do_sample": "a request's temperature decides sampling (vLLM's rule)",
    "bos_token_id": "the tokenizer's bos is used",
    "pad_token_id": "openk3 never pads",
    "transformers_version": "bookkeeping",
    "_from_model_config": "bookkeeping",
}
log = logging.getLogger("openk3.serve")


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    origin: str | None = None  # the file read, None without one

    def log(self) -> None:
        if self.origin is None:
            return
        log.info("%s: stop tokens %s, sampling defaults %s", self.origin, list(self.eos_token_ids) or "none", self.defaults or "none")


def read_generation_config(folder: Path | None) -> GenerationConfig:
    """The folder's generation_config.json (an empty config without one); a file that is not a JSON object, or an eos id or
    sampling value of the wrong kind, is a ValueError naming the file and the key."""
    file = None if folder is None else Path(folder) / FILE
    if file is None or not file.is_file():
        return GenerationConfig()
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object")
    eos = raw.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id={eos!r} must be a token id or a list of them")
    defaults = {}
    for key, name in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{file}: {key}={value!r} must be a number")
        defaults[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    skipped = {k: _SKIP_WHY.get(k, "not a setting openk3 reads") for k in raw if k != "eos_token_id" and k not in SAMPLING_KEYS}
    if skipped:
        log.info("%s: skipped %s", file, "; ".join(f"{k} ({why})" for k, why in skipped.items()))
    return GenerationConfig(tuple(dict.fromkeys(ids)), defaults, str(file))
