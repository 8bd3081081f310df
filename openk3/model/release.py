"""What the K3 release holds beyond this text model, and how it stores what it shares (as three third-party loaders describe it).

- `A_log` is stored F32[128] for 96 heads, zero-padded: accepted when every padded entry is zero, otherwise an error that
  names the tensor and both shapes.
- The multimodal checkpoint prefixes the text model `language_model.` (weights.canonical_name strips it) and ships a vision
  tower (`vision_tower.*`) and projector (`mm_projector.*`): loaded into the model's own (model/vision.py), not skipped.
- Multi-token-prediction (MTP) layers (`mtp.*`, or decoder layers past num_hidden_layers as DeepSeek-V3-style checkpoints
  number them): not part of the text model; read only for speculative decoding with method "mtp" (model/mtp_load.py),
  skipped otherwise.
Skipped tensors are never read, and each kind gets one log line saying how many and why.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

import torch

from openk3.config import ModelConfig

LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
MTP_OWN_RE = re.compile(r"^model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head)\.")  # what only an MTP layer holds
log = logging.getLogger("openk3.model")


def release_extras(names: Sequence[str], config: ModelConfig, declared_mtp: int = 0) -> dict[str, str]:
    """The checkpoint's tensors that are not part of this model, each with its kind: "mtp" (multi-token prediction, read
    by model/mtp_load.py when speculative decoding uses it: `mtp.*` / `model.mtp.*`, or a decoder layer past num_hidden_layers that config.json
    declares as MTP or that holds MTP's own tensors). Every other name is left to load_state_dict_into, which refuses the
    ones it does not know."""
    n = config.num_hidden_layers
    text = [name.removeprefix("language_model.") for name in names]
    mtp_layers = set(range(n, n + declared_mtp)) | {int(m.group(1)) for t in text if (m := MTP_OWN_RE.match(t)) and int(m.group(1)) >= n}
    extras: dict[str, str] = {}
    for name, t in zip(names, text, strict=True):
        layer = LAYER_RE.match(t)
        if t.startswith(("mtp.", "model.mtp.")) or (layer is not None and int(layer.group(1)) in mtp_layers):
            extras[name] = "mtp"
    return extras


def log_extras(extras: Mapping[str, str], config: ModelConfig) -> None:
    mtp = [n for n, kind in extras.items() if kind == "mtp"]
    layers = sorted({int(m.group(1)) for n in mtp if (m := LAYER_RE.match(n.removeprefix("language_model.")))})
    where = f" (layers {', '.join(map(str, layers))}, past num_hidden_layers={config.num_hidden_layers})" if layers else ""
    if mtp:
        log.info("skipping %d multi-token-prediction tensors%s: read only for speculative decoding with method 'mtp'", len(mtp), where)


def fit_a_log(raw_name: str, tensor: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """A_log as [H], as transformers' [1, 1, H, 1], or zero-padded as the K3 release stores it ([128] for 96 heads):
    the padding is dropped only when every padded entry is zero; otherwise the problem, naming the tensor and the shapes."""
    h = target.numel()
    if tensor.numel() == h:
        return tensor.reshape(target.shape), None
    if tensor.dim() == 1 and tensor.numel() > h:
        if torch.count_nonzero(tensor[h:]) == 0:
            return tensor[:h].reshape(target.shape), None
        return (
            tensor,
            f"tensor {raw_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} or zero padding after it: entries {h}.. are not all zero",
        )
    return tensor, None  # the caller reports the shape
