"""A synthetic checkpoint in the K3 release layout loads and serves: `language_model.` prefixes, a kimi_k3 config.json, sharded
safetensors, MXFP4 experts (weight_packed / weight_scale / weight_shape), A_log zero-padded, MTP tensors to skip, a vision
tower and projector to load (`vision_tower.*`, `mm_projector.*`), and the Kimi tokenizer folder. The same weights saved in
openk3's own format are the reference, token for token."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from openk3.config import config_to_hf, debug
from openk3.config.vision import vision_from_hf
from openk3.llm import LLM
from openk3.model import CheckpointError, K3ForCausalLM, load_model, save_model
from openk3.model.release import release_extras
from openk3.model.weights import export_state_dict
from openk3.serve.sampling import SamplingParams
from tests.model.test_vision import SMALL_K3, randomise
from tests.serve.test_kimi_tokenizer import write_kimi_tokenizer

from .conftest import build

A_LOG_STORED = 16  # the release stores 128 entries for 96 heads; debug() has 2 heads
MTP_LAYER = debug().num_hidden_layers  # DeepSeek-V3-style numbering: the MTP layer follows the decoder layers


def mtp_tensors(hidden: int) -> dict[str, torch.Tensor]:
    layer = f"language_model.model.layers.{MTP_LAYER}"
    return {
        f"{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
        f"{layer}.enorm.weight": torch.ones(hidden),
        f"{layer}.hnorm.weight": torch.ones(hidden),
        f"{layer}.input_layernorm.weight": torch.ones(hidden),
        f"{layer}.self_attn.q_a_proj.weight": torch.randn(32, hidden),
        f"{layer}.block_sparse_moe.experts.0.w1.weight_packed": torch.zeros(32, 16, dtype=torch.uint8),
        f"{layer}.shared_head.norm.weight": torch.ones(hidden),
    }


VISION_CONFIG = SMALL_K3 | {"text_hidden_size": debug().hidden_size}


@functools.cache
def vision_tensors() -> dict[str, torch.Tensor]:
    """Random weights of a small tower in the release's names (K3's switches: wider attention, RMSNorm, no biases)."""
    model = K3ForCausalLM(debug(), vision=vision_from_hf(VISION_CONFIG, debug().hidden_size))
    randomise(model, 5)
    return {n: t for n, t in model.state_dict().items() if n.startswith(("vision_tower.", "mm_projector."))}


def release_tensors(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in export_state_dict(model).items():
        if name.endswith("self_attn.A_log"):
            t = torch.cat([t.float(), torch.zeros(A_LOG_STORED - t.numel())])
        out["language_model." + name] = t
        if name.endswith(".weight_packed"):  # compressed-tensors records each packed weight's dense shape
            out["language_model." + name.replace("weight_packed", "weight_shape")] = torch.tensor([t.shape[0], 2 * t.shape[1]])
    return out | mtp_tensors(model.config.hidden_size) | vision_tensors()


def write_release(path: Path, model: K3ForCausalLM, tensors: dict[str, torch.Tensor], shards: int = 3, specials: dict[int, str] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = config_to_hf(model.config.replace(expert_quantization="mxfp4"))
    quant = text.pop("quantization_config")
    text["num_nextn_predict_layers"] = 1
    config = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text, "quantization_config": quant}
    config["vision_config"] = VISION_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_kimi_tokenizer(path, specials=specials)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[K3ForCausalLM, Path, Path]:
    root = tmp_path_factory.mktemp("release")
    vocab = write_kimi_tokenizer(root / "probe")
    model = build(debug().replace(vocab_size=vocab))
    model.quantize_experts()  # the release's routed experts are MXFP4
    own = root / "own"
    save_model(model, own)
    write_kimi_tokenizer(own)
    return model, own, write_release(root / "k3", model, release_tensors(model))


def test_release_folder_loads_the_same_weights_and_logs_each_skip_once(folders, caplog) -> None:
    model, own, release = folders
    with caplog.at_level(logging.INFO, logger="openk3.model"):
        loaded = load_model(release)
    lines = [r.getMessage() for r in caplog.records if r.name == "openk3.model"]
    assert lines == [
        f"skipping 7 multi-token-prediction tensors (layers {MTP_LAYER}, past num_hidden_layers={MTP_LAYER}): "
        "read only for speculative decoding with method 'mtp'",
    ]
    state = loaded.state_dict()
    assert loaded.vision == vision_from_hf(VISION_CONFIG, model.config.hidden_size)
    assert all(torch.equal(state[n], t) for n, t in vision_tensors().items())
    tokens = torch.randint(0, model.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_model(own).forward_tokens(tokens)
        torch.testing.assert_close(loaded.forward_tokens(tokens), want, atol=0, rtol=0)
        torch.testing.assert_close(model.forward_tokens(tokens), want, atol=0, rtol=0)


def test_release_folder_serves_end_to_end(folders) -> None:
    _, own, release = folders
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "The quick brown fox \u4eca\u5929"
    outs = {}
    for name, path in (("own", own), ("release", release)):
        llm = LLM(str(path), num_pages=16, page_size=4, max_num_seqs=2, max_model_len=64)
        assert type(llm.tokenizer).__name__ == "KimiTokenizer"
        (out,) = llm.generate(prompt, greedy)
        assert out.prompt_token_ids == tuple(llm.tokenizer.encode(prompt)) and len(out.token_ids) == 8
        assert out.text == llm.tokenizer.decode(list(out.token_ids))
        outs[name] = out.token_ids
        llm.close()
    assert outs["release"] == outs["own"]


def test_an_expert_parallel_rank_loads_its_experts_from_the_release_layout(folders) -> None:
    model, _, release = folders
    part = load_model(release, experts={1: [3, 0]})
    rows = part.state_dict()["model.layers.1.block_sparse_moe.experts.w1_weight_packed"]
    full = model.state_dict()["model.layers.1.block_sparse_moe.experts.w1_weight_packed"]
    assert torch.equal(rows, full[[3, 0]])


def test_a_log_padding_must_be_zero(folders, tmp_path: Path) -> None:
    model, _, _ = folders
    tensors = release_tensors(model)
    name = "language_model.model.layers.0.self_attn.A_log"
    tensors[name] = tensors[name].clone()
    tensors[name][-1] = 0.5
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(16,\), expected \(2,\) or zero padding after it: entries 2.. are not all zero"):
        load_model(write_release(tmp_path / "bad", model, tensors, shards=1))


def test_other_unknown_tensors_stay_errors(folders, tmp_path: Path) -> None:
    model, _, _ = folders
    tensors = release_tensors(model)
    tensors["language_model.model.layers.2.self_attn.surprise"] = torch.zeros(3)
    tensors[f"language_model.model.layers.{MTP_LAYER + 1}.input_layernorm.weight"] = torch.ones(64)  # not declared, not MTP-shaped
    tensors["audio_tower.conv.weight"] = torch.zeros(2)
    tensors["vision_tower.encoder.blocks.2.wqkv.weight"] = torch.zeros(108, 22)  # the tower has 2 blocks
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)  # Kimi-VL's projector, not K3's
    tensors["mm_projector.post_norm.weight"] = torch.ones(7)
    del tensors["vision_tower.encoder.blocks.1.mlp.fc0.weight"]
    with pytest.raises(CheckpointError) as err:
        load_model(write_release(tmp_path / "bad", model, tensors, shards=1))
    msg = str(err.value)
    for name in ("model.layers.2.self_attn.surprise", f"model.layers.{MTP_LAYER + 1}.input_layernorm.weight"):
        assert f"unexpected tensor language_model.{name}" in msg
    for name in ("audio_tower.conv.weight", "vision_tower.encoder.blocks.2.wqkv.weight", "multi_modal_projector.linear_1.weight"):
        assert f"unexpected tensor {name}" in msg
    assert f"tensor mm_projector.post_norm.weight has shape (7,), expected ({model.config.hidden_size},)" in msg
    assert "missing tensor vision_tower.encoder.blocks.1.mlp.fc0.weight, expected shape (37, 22)" in msg


def test_vision_tensors_without_a_vision_config_are_refused(folders, tmp_path: Path) -> None:
    model, _, _ = folders
    path = write_release(tmp_path / "text_only_config", model, release_tensors(model), shards=1)
    config = json.loads((path / "config.json").read_text())
    del config["vision_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected tensor mm_projector\.proj\.0\.weight \(88, 88\) \(config.json declares no vision_config\)"):
        load_model(path)


def test_the_loaded_tower_encodes_as_the_saved_one(folders, tmp_path: Path) -> None:
    model, _, release = folders
    loaded = load_model(release)
    save_model(loaded, tmp_path / "again")
    again = load_model(tmp_path / "again")
    grids = [(1, 4, 6), (2, 2, 2)]
    pixels = torch.randn(32, 3, 3, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = loaded.encode_images(pixels, grids)
        torch.testing.assert_close(again.encode_images(pixels, grids), out, atol=0, rtol=0)
    assert out.shape == (6 + 1, model.config.hidden_size)


def test_which_names_are_release_extras() -> None:
    config = debug()
    names = [
        "language_model.mtp.layers.0.eh_proj.weight",
        "model.mtp.norm.weight",
        "model.layers.5.self_attn.o_proj.weight",  # layer 5 is MTP only where declared or MTP-shaped
        "model.layers.4.eh_proj.weight",  # a decoder layer never is
        "mm_projector.proj.0.weight",  # the vision tower's: loaded, never an extra
        "language_model.model.layers.0.self_attn.q_proj.weight",
    ]
    assert release_extras(names, config) == {names[0]: "mtp", names[1]: "mtp"}
    assert release_extras(names, config, declared_mtp=1) == {names[0]: "mtp", names[1]: "mtp", names[2]: "mtp"}
    shaped = ["language_model.model.layers.6.enorm.weight", "language_model.model.layers.6.mlp.down_proj.weight"]
    assert release_extras(shaped, config) == dict.fromkeys(shaped, "mtp")  # an undeclared layer holding MTP's own tensors
