"""What openk3 does with each file of a checkpoint folder, said once at start-up: the released K3 folder ships Python code
(its tokenizer, its prompt encoding, its model and processor) that openk3 never runs, and each such file is named with the
built-in implementation that stands for it, so nothing in a folder is silently ignored."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("openk3.serve")

_NOT_RUN = "not run: openk3's own"
KNOWN: dict[str, str] = {
    "config.json": "read: the model's shape (openk3/config/hf.py)",
    "generation_config.json": "read: stop tokens and sampling defaults (serve/generation_config.py)",
    "tokenizer_config.json": "read: special tokens, and the chat template or encoding (serve/kimi_tokenizer.py, api/chat.py)",
    "tiktoken.model": "read: the BPE ranks (serve/kimi_tokenizer.py)",
    "tokenizer.json": "read: the tokenizer (the tokenizers package)",
    "chat_template.jinja": "read: the chat template (api/chat.py), unless the folder is served with K3's encoding",
    "model.safetensors.index.json": "read: which shard holds each tensor",
    "tokenization_kimi.py": f"{_NOT_RUN} serve/kimi_tokenizer.py implements it",
    "encoding_k3.py": f"{_NOT_RUN} api/k3_encoding.py implements it (K3's prompt encoding)",
    "configuration_kimi_k3.py": f"{_NOT_RUN} openk3/config reads config.json",
    "modeling_kimi_k3.py": f"{_NOT_RUN} openk3/model implements the model",
    "modeling_kimi_linear.py": f"{_NOT_RUN} openk3/model implements the model",
    "kimi_k3_processor.py": f"{_NOT_RUN} serve/vision_processor.py and api/images.py implement it",
    "kimi_k3_vision_processing.py": f"{_NOT_RUN} serve/vision_processor.py implements it",
    "media_utils.py": f"{_NOT_RUN} serve/vision_processor.py implements its image resize",
    "preprocessor_config.json": "read: media_proc_cfg, the image processor's limits (serve/vision_processor.py)",
    "added_tokens.json": "skipped: tokenizer_config.json's added_tokens_decoder names the special tokens",
    "special_tokens_map.json": "skipped: tokenizer_config.json names the bos and eos",
}


def folder_files(folder: Path) -> list[tuple[str, str]]:
    """Each file of `folder` with what openk3 does with it (weight shards are one entry), then each subfolder: none is read
    with the model; one holding an EAGLE-3 head (the demo's `eagle3/`) is named as the draft it can be."""
    out, shards = [], []
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        if file.suffix == ".safetensors":
            shards.append(file.name)
        elif file.name in KNOWN:
            out.append((file.name, KNOWN[file.name]))
        elif file.suffix == ".md" or file.name.startswith((".", "LICENSE")):
            continue  # model cards, licences, dot files: documents, not inputs
        else:
            out.append((file.name, "skipped: not a file openk3 reads"))
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))):
        head = (sub / "config.json").is_file() and "Eagle3" in (sub / "config.json").read_text()
        what = "an EAGLE-3 draft head, read only as speculative_model with speculative_method eagle3" if head else "a subfolder"
        out.append((f"{sub.name}/", f"not read with the model: {what}"))
    if shards:
        out.insert(
            0,
            (
                f"{len(shards)} safetensors shard(s)",
                "read: the weights (model/weights.py; the vision tower with them; MTP tensors are skipped, see model/release.py)",
            ),
        )
    return out


def log_folder_files(folder: Path) -> None:
    log.info("model folder %s:\n%s", folder, "\n".join(f"  {name}: {what}" for name, what in folder_files(folder)))
