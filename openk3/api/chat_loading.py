"""Which renders a model folder's chats, in order: an explicit `--chat-template` file; K3's encoding (api/chat_k3.py) for a
K3 folder (config.json's model_type `kimi_k3`, or an `encoding_k3.py` beside the weights: its code is never run, openk3's
own encoding stands for it) and for a folder whose tokenizer_config.json says `"chat_encoding": "kimi_k3"` (openk3's key,
which the demo model uses; another value is an error); then `chat_template.jinja`, then the `chat_template` entry of
`tokenizer_config.json`; else a ChatML-style default (the byte-tokenizer presets, a bare folder). The choice is logged."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from openk3.api.chat import ChatTemplate
from openk3.api.chat_k3 import K3Template

K3_ENCODING = "kimi_k3"  # tokenizer_config.json's "chat_encoding" value that names K3's encoding
ChatRenderer = ChatTemplate | K3Template
log = logging.getLogger("openk3.api")


def _from_tokenizer_config(file: Path) -> str | None:
    try:
        entry = json.loads(file.read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(entry, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    return entry if isinstance(entry, str) else None


def _k3_origin(model_dir: Path) -> str | None:
    """Why `model_dir` is served with K3's encoding (module docstring), or None when it is not."""
    config = _json_file(model_dir / "config.json")
    if config.get("model_type") == "kimi_k3":
        return f"Kimi K3's encoding (openk3/api/k3_encoding.py), for {model_dir / 'config.json'}: model_type kimi_k3"
    if (model_dir / "encoding_k3.py").is_file():
        return f"Kimi K3's encoding (openk3/api/k3_encoding.py), standing for {model_dir / 'encoding_k3.py'} (never run)"
    named = _json_file(model_dir / "tokenizer_config.json").get("chat_encoding")
    if named is None:
        return None
    if named != K3_ENCODING:
        raise ValueError(f"{model_dir / 'tokenizer_config.json'}: chat_encoding={named!r} is not one openk3 has; the one it has: {K3_ENCODING!r}")
    return f"Kimi K3's encoding (openk3/api/k3_encoding.py), named by {model_dir / 'tokenizer_config.json'} chat_encoding"


def _json_file(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def load_chat_template(model_dir: Path | None, explicit: Path | None = None) -> ChatRenderer:
    """What renders the model's chats (module docstring for the order); the choice is logged."""
    renderer = _chat_renderer(model_dir, explicit)
    log.info("chat prompts: %s", renderer.origin)
    return renderer


def _chat_renderer(model_dir: Path | None, explicit: Path | None) -> ChatRenderer:
    if explicit is not None:
        if not explicit.is_file():
            raise ValueError(f"--chat-template {explicit}: no such file")
        return ChatTemplate(explicit.read_text(), str(explicit))
    if model_dir is not None:
        k3 = _k3_origin(model_dir)
        if k3 is not None:
            return K3Template(k3)
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return ChatTemplate(jinja.read_text(), str(jinja))
        config = model_dir / "tokenizer_config.json"
        source = _from_tokenizer_config(config) if config.is_file() else None
        if source is not None:
            return ChatTemplate(source, str(config))
    return ChatTemplate.default()
