"""Where a model comes from: a preset name ("tiny", "debug"), a checkpoint folder (config.json + safetensors + its tokenizer:
tokenizer.json, or a Kimi tiktoken.model with tokenizer_config.json), or a preset with no shipped checkpoint, built with
seeded random weights and the byte tokenizer (it says so with a warning: its text is noise, but every code path is the real
one). A checkpoint folder without a loadable tokenizer is an error naming the files looked for; `openk3 serve --tokenizer byte`
(EngineSpec.byte_tokenizer) asks for the byte tokenizer instead (with the config's bos/eos ids). Used by `LLM`, `openk3 serve` and every expert-parallel rank.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from openk3.config import PRESETS, ModelConfig, config_from_hf, preset
from openk3.serve.runner import CausalLM
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def resolve_model(model: str | Path) -> Path | None:
    """The checkpoint folder `model` names (a shipped preset's included), or None for a preset built from its seed."""
    name = str(model)
    shipped = ASSETS / name
    if name in PRESETS and (shipped / "config.json").is_file():
        return shipped
    if name in PRESETS:
        return None
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model={name!r} is neither a preset ({sorted(PRESETS)}) nor a folder with config.json")
    return path


def _warn_random(name: str, seed: int) -> None:
    warnings.warn(
        f"model {name!r}: no checkpoint is shipped for this preset, using seeded random weights (seed {seed}) and the byte tokenizer",
        stacklevel=4,
    )


def build_model(
    model: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    byte_tokenizer: bool = False,
    tokenizer: Tokenizer | None = None,
    mtp: bool = False,
) -> tuple[CausalLM, Tokenizer]:
    """The model and its tokenizer; `tokenizer`: the caller's own, so the checkpoint's is not looked for; `mtp`: the caller
    reads the checkpoint's multi-token-prediction layer itself (model/mtp_load.py)."""
    from openk3.model import K3ForCausalLM, load_model

    path = resolve_model(model)
    if path is None:
        _warn_random(str(model), seed)
        config = preset(str(model))
        net = K3ForCausalLM(config)
        net.init_weights(seed)
        net = net.to(device=device, dtype=dtype).eval()
        return net, tokenizer or ByteTokenizer(config.vocab_size)
    tokenizer = tokenizer or checkpoint_tokenizer(path, config_from_hf(path), byte_tokenizer)  # before the weights: fails fast
    return load_model(path, dtype=dtype, device=device, mtp=mtp), tokenizer


def model_tokenizer(model: str | Path, seed: int, byte_tokenizer: bool = False) -> Tokenizer:
    """The tokenizer build_model would return, without building the model (expert-parallel ranks build their own)."""
    path = resolve_model(model)
    if path is None:
        _warn_random(str(model), seed)
        return ByteTokenizer(preset(str(model)).vocab_size)
    return checkpoint_tokenizer(path, config_from_hf(path), byte_tokenizer)


class ConfigIdsByteTokenizer(ByteTokenizer):
    """The byte tokenizer asked for in place of a checkpoint's own, with the bos/eos ids its config names: the checkpoint
    was trained to end on its config's eos, and the byte tokenizer's own <|eos|> is an id the model never learned to emit,
    so generation would never stop there. An id the config leaves unset keeps the byte tokenizer's."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None) -> None:
        super().__init__(vocab_size)
        self._config_bos = bos_token_id
        self._config_eos = eos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._config_eos if self._config_eos is not None else super().eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._config_bos if self._config_bos is not None else super().bos_token_id


def checkpoint_tokenizer(path: Path, config: ModelConfig, byte_tokenizer: bool = False) -> Tokenizer:
    """The folder's tokenizer (an error naming the files looked for when it has none); with `byte_tokenizer`, the byte
    tokenizer sized to the model's vocabulary with the config's bos/eos ids, whatever the folder holds."""
    if not byte_tokenizer:
        return load_tokenizer(path, config.vocab_size)
    vocab_size = max(config.vocab_size, 256)  # a vocabulary smaller than 256 still decodes; the engine rejects ids it lacks
    if config.bos_token_id is not None or config.eos_token_id is not None:
        return ConfigIdsByteTokenizer(vocab_size, config.bos_token_id, config.eos_token_id)
    return ByteTokenizer(vocab_size)
