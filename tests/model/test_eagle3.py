"""The EAGLE-3 head and its loader (model/eagle3.py, model/eagle3_load.py) and the target's aux hidden states
(K3Model.forward_with_aux): the aux tensor is the hidden state entering the layer (the residual stream without AttnRes,
the block's partial sum with it) in every AttnRes form; every tensor of a published-layout folder is placed; what the
loader cannot run is refused by name; the head's packed forward over several sequences with kept keys equals one
cache-free forward per sequence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from openk3.config import debug
from openk3.model import CheckpointError, K3ForCausalLM
from openk3.model.batch import ForwardBatch
from openk3.model.eagle3 import Past
from openk3.model.eagle3_load import load_eagle3
from openk3.model.model import OpChoice
from tests.model.conftest import build
from tests.model.eagle3_folder import head_config, head_tensors, write_head


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    return build(debug())


def test_aux_without_attn_res_is_the_residual_stream_entering_the_layer() -> None:
    model = build(debug().replace(attn_res_block_size=None))
    ids = torch.tensor([[3, 9, 27, 81, 243 % 256, 5, 7]])
    batch = ForwardBatch.from_tokens(ids)
    with torch.no_grad():
        h, aux = model.aux_hidden_states(batch, None, (1, 3, 4))
        x = model.model.embed_tokens(ids[0])
        entering = {}
        for layer in model.model.layers:
            entering[layer.index] = x
            x = x + layer.attention(x, batch, None, model.model.cache_index[layer.index])
            x = x + layer.feed_forward(layer.post_attention_layernorm(x))
        torch.testing.assert_close(h, model.model.norm(x))
    torch.testing.assert_close(aux, torch.cat([entering[1], entering[3], entering[4]], -1))


@pytest.mark.parametrize("form", ["naive", "fast"])
def test_aux_with_attn_res_is_the_blocks_partial_sum(target: K3ForCausalLM, form: str) -> None:
    """debug(): AttnRes blocks of 2 layers; entering layer 3 the partial sum is layer 2's two sublayer outputs, entering
    layer 4 (a block start, taken before the block is stored) it is layers 2 and 3's four."""
    target.select_ops(OpChoice(attn_res=form))
    outs: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for layer in target.model.layers:
        ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
        for module in (layer.self_attn, ffn):
            hooks.append(module.register_forward_hook(lambda _m, _i, out, i=layer.index: outs.setdefault(i, []).append(out)))
    try:
        with torch.no_grad():
            h, aux = target.aux_hidden_states(ForwardBatch.from_tokens(torch.tensor([[1, 2, 3, 4, 5, 6, 200]])), None, (3, 4, 1))
    finally:
        for hook in hooks:
            hook.remove()
        target.select_ops(OpChoice())
    d = target.config.hidden_size
    torch.testing.assert_close(aux[:, :d], outs[2][0] + outs[2][1])
    torch.testing.assert_close(aux[:, d : 2 * d], outs[2][0] + outs[2][1] + outs[3][0] + outs[3][1])
    torch.testing.assert_close(aux[:, 2 * d :], outs[0][0] + outs[0][1])


def test_every_tensor_is_placed(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = head_config(target.config, 100, [1, 2, 4])
    tensors = head_tensors(target.config, cfg, own_embedding=True)
    head = load_eagle3(write_head(tmp_path / "h", cfg, tensors), target)
    state = head.state_dict()
    assert sorted(state) == sorted(tensors)
    assert all(torch.equal(state[n], tensors[n]) for n in tensors)
    assert head.config.aux_layer_ids == (1, 2, 4) and head.config.num_key_value_heads == 2 and head.embed_tokens is not None


def test_the_default_aux_layers_and_the_targets_embedding(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = head_config(target.config, target.config.vocab_size, None)
    tensors = head_tensors(target.config, cfg)
    del tensors["d2t"], tensors["t2d"]  # a head over the whole vocabulary may leave them out
    head = load_eagle3(write_head(tmp_path / "h", cfg, tensors), target)
    assert head.config.aux_layer_ids == (2, 2, 2)  # [2, L // 2, L - 3] of 5 layers
    assert head.embed_tokens is None and head.target_parts[0] is target.model.embed_tokens
    assert torch.equal(head.d2t, torch.zeros(target.config.vocab_size, dtype=torch.long))


def test_a_kimi_k25_head_configs_fields_are_read(target: K3ForCausalLM, tmp_path: Path) -> None:
    """The fields of TorchSpec's Kimi-K2.5 EAGLE-3 config (configs/draft_models/kimi_k25_eagle3.json), at this target's
    size: Qwen2's sliding-window fields (off), rope_scaling null, no draft_vocab_size (the whole vocabulary)."""
    cfg = head_config(target.config, target.config.vocab_size, None)
    del cfg["draft_vocab_size"], cfg["pad_token_id"]
    extra = dict(attention_bias=False, attention_dropout=0.0, head_dim=16, max_window_layers=36, rope_scaling=None, sliding_window=None)
    cfg |= extra | dict(use_sliding_window=False, rope_theta=1000000)
    tensors = head_tensors(target.config, cfg | {"draft_vocab_size": target.config.vocab_size})
    del tensors["d2t"], tensors["t2d"]
    head = load_eagle3(write_head(tmp_path / "k25", cfg, tensors), target)
    assert head.config.draft_vocab_size == head.config.vocab_size and head.config.rope_theta == 1e6
    (tmp_path / "k25" / "config.json").write_text(json.dumps(cfg | dict(use_sliding_window=True)))
    with pytest.raises(CheckpointError, match="use_sliding_window=True: openk3's EAGLE-3 head supports False only"):
        load_eagle3(tmp_path / "k25", target)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (dict(architectures=["DeepseekV3ForCausalLMEagle3"]), "MLA draft layer"),
        (dict(num_hidden_layers=2), "one-layer EAGLE-3 heads"),
        (dict(layer_types=["full_attention"]), r"keys \['layer_types'\] are not read"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}), r"in \[1, 4\] of the target's 5 layers"),
        (dict(vocab_size=300), "drafts for another tokenizer"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'default' or 'llama3'"),
        (dict(target_hidden_size=128), "differs from the target's hidden_size=64"),
    ],
)
def test_a_config_it_cannot_run_is_refused_by_name(target: K3ForCausalLM, tmp_path: Path, change: dict, error: str) -> None:
    cfg = head_config(target.config, 100, [1, 2, 4])
    tensors = head_tensors(target.config, cfg)
    path = write_head(tmp_path / "h", cfg, tensors)
    (path / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(CheckpointError, match=error):
        load_eagle3(path, target)


def test_tensors_that_do_not_fit_are_named(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = head_config(target.config, 100, [1, 2, 4])
    tensors = head_tensors(target.config, cfg)
    tensors["midlayer.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    del tensors["midlayer.hidden_norm.weight"]
    tensors["fc.weight"] = torch.zeros(64, 128)
    with pytest.raises(CheckpointError) as err:
        load_eagle3(write_head(tmp_path / "h", cfg, tensors), target)
    assert "midlayer.self_attn.rotary_emb.inv_freq: not part of an EAGLE-3 head" in str(err.value)
    assert "midlayer.hidden_norm.weight: missing" in str(err.value)
    assert "fc.weight: shape (64, 128), expected (64, 192)" in str(err.value)


def test_a_d2t_that_maps_two_draft_ids_to_one_target_id_is_refused(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = head_config(target.config, 100, [1, 2, 4])
    tensors = head_tensors(target.config, cfg)
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft id 1 -> the target id of draft id 0
    with pytest.raises(CheckpointError, match="onto one target id twice"):
        load_eagle3(write_head(tmp_path / "h", cfg, tensors), target)


def test_the_layers_packed_form_over_kept_keys_equals_one_forward_per_sequence(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = head_config(target.config, 100, [1, 2, 4])
    head = load_eagle3(write_head(tmp_path / "h", cfg, head_tensors(target.config, cfg)), target)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3]
    ids = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    hidden = [torch.randn(n, 64, generator=g) for n in lengths]
    with torch.no_grad():
        whole = [head(i, h, torch.arange(len(i)), [Past(0, len(i), torch.empty(0, 2, 16), torch.empty(0, 2, 16))]) for i, h in zip(ids, hidden, strict=True)]
        # the first 3 and 1 positions as kept keys, the rest of both sequences packed into one call
        split = [3, 1]
        rows = torch.cat([i[s:] for i, s in zip(ids, split, strict=True)])
        rows_h = torch.cat([h[s:] for h, s in zip(hidden, split, strict=True)])
        positions = torch.cat([torch.arange(s, n) for s, n in zip(split, lengths, strict=True)])
        pasts = [Past(0, 2, whole[0][1][:3], whole[0][2][:3]), Past(2, 4, whole[1][1][:1], whole[1][2][:1])]
        x, k, _ = head(rows, rows_h, positions, pasts)
    torch.testing.assert_close(x, torch.cat([whole[0][0][3:], whole[1][0][1:]]))
    torch.testing.assert_close(k, torch.cat([whole[0][1][3:], whole[1][1][1:]]))


def test_llama3_rope_frequencies_match_transformers() -> None:
    """Llama 3.1's rope_scaling against transformers' own (a test-only peer oracle)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from openk3.model.eagle3 import Eagle3Config, rope_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    cfg = Eagle3Config(4096, 32, 8, 128, 14336, 1000, 1000, 4096, (2, 16, 29), rope_theta=500000.0, rope_llama3=(8.0, 1.0, 4.0, 8192))
    torch.testing.assert_close(rope_frequencies(cfg), want.float())


def test_norm_before_residual_adds_the_normed_hidden_state(target: K3ForCausalLM, tmp_path: Path) -> None:
    cfg = head_config(target.config, 100, [1, 2, 4], norm_before_residual=True)
    head = load_eagle3(write_head(tmp_path / "h", cfg, head_tensors(target.config, cfg)), target)
    g = torch.randn(3, 64)
    with torch.no_grad():
        residual, x2 = head.layer_input(torch.tensor([1, 2, 3]), g)
        torch.testing.assert_close(residual, head.midlayer.hidden_norm(g))
        torch.testing.assert_close(x2[:, 64:], residual)
