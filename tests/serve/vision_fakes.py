"""A tiny K3 model with a random MoonViT tower (debug text model, 3-pixel patches) and a byte tokenizer that has K3's media
tokens, shared by the engine and server tests of image input."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from openk3.config import debug
from openk3.config.vision import VisionConfig, VisionNorm
from openk3.model import K3ForCausalLM
from openk3.serve.media_prompt import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD
from openk3.serve.tokenizer import ByteTokenizer
from openk3.serve.vision_processor import MediaConfig

PATCH = 3
MEDIA = MediaConfig(patch_size=PATCH, merge_kernel_size=2, in_patch_limit=64, patch_limit_on_one_side=16)


def tiny_vision_model(seed: int = 5) -> K3ForCausalLM:
    text = debug()
    vision = VisionConfig(24, 2, 2, 40, text.hidden_size, patch_size=PATCH, pos_emb_height=4, pos_emb_width=6, norm=VisionNorm.RMSNORM)
    m = K3ForCausalLM(text, vision=vision)
    m.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # a tower whose output is not tiny, so that a misplaced row changes the text's logprobs
        for name, p in m.named_parameters():
            if name.startswith(("vision_tower.", "mm_projector.")) and "norm" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m.eval()


class MediaByteTokenizer(ByteTokenizer):
    """Bytes, plus K3's four media markers as special tokens 252..255 (bytes no UTF-8 text contains)."""

    MARKERS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
    max_bytes_per_token = max(len(m) for m in MARKERS)

    def __init__(self) -> None:
        super().__init__(256)
        self.ids = {m: 252 + i for i, m in enumerate(self.MARKERS)}
        self._pattern = re.compile("|".join(re.escape(m) for m in self.MARKERS))

    @property
    def special_token_strings(self) -> frozenset[str]:
        return frozenset(self.MARKERS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_with_plain(text, ())

    def encode_with_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        ids, at = [], 0
        for m in self._pattern.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in plain):
                continue  # request text that spells a marker stays text
            ids += list(text[at : m.start()].encode()) + [self.ids[m.group()]]
            at = m.end()
        return ids + list(text[at:].encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        names = {i: m for m, i in self.ids.items()}
        out, run = [], []
        for t in [*token_ids, None]:
            if t is not None and t not in names:
                run.append(t)
                continue
            out.append(super().decode(run, skip_special_tokens))
            run = []
            if t is not None:
                out.append("" if skip_special_tokens else names[t])
        return "".join(out)
