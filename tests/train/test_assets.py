"""The shipped demo model: loads offline in the K3 layout, its tokenizer loads in the server, its weights are trained, and its
vision tower is read whole (every `vision_tower.*` / `mm_projector.*` tensor of the file is a weight of the model, bit for bit)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

import openk3
from openk3.model import load_model
from openk3.model.moe import PackedExperts
from openk3.serve.tokenizer import HFTokenizer, load_tokenizer

TINY = Path(openk3.__file__).parent / "assets" / "tiny"
TEXT = (
    "And God said, Let there be light: and there was light.\n"
    "And God saw the light, that it was good: and God divided the light from the darkness.\n"
    "And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day."
)


def test_shipped_folder_is_small_and_complete():
    names = {p.name for p in TINY.iterdir()}
    want = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md", "loss.png", "preprocessor_config.json"}
    assert want <= names
    assert sum(p.stat().st_size for p in TINY.iterdir()) < 30 * 2**20


def test_loads_with_mxfp4_experts_and_predicts_the_corpus():
    torch.set_num_threads(1)
    model = load_model(TINY)
    assert all(isinstance(m.experts, PackedExperts) for m in model.moe_layers())
    assert model.config.expert_quantization == "mxfp4"
    tok = load_tokenizer(TINY, model.config.vocab_size)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == model.config.vocab_size == 4100  # 4096 + the four media tokens
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        logits = model.forward_tokens(ids[:, :-1])
    loss = F.cross_entropy(logits[0].float(), ids[0, 1:])
    assert loss < 4.0, f"shipped weights look untrained: loss {loss:.2f} (uniform would be {torch.log(torch.tensor(4100.0)):.2f})"


def test_every_vision_tensor_of_the_shipped_folder_is_consumed():
    model = load_model(TINY, dtype=torch.bfloat16)
    assert model.vision is not None, "config.json has no vision_config"
    held = {k: v for k, v in model.state_dict().items() if k.startswith(("vision_tower.", "mm_projector."))}
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        shipped = {k: f.get_tensor(k) for k in f.keys() if k.startswith(("vision_tower.", "mm_projector."))}
    assert sorted(shipped) == sorted(held)  # none skipped, none left at its initial value
    assert sum(t.numel() for t in shipped.values()) == 271_680  # the card's figure
    for name, tensor in shipped.items():
        assert held[name].dtype == tensor.dtype and torch.equal(held[name], tensor), name
