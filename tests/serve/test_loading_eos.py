"""A checkpoint folder without a tokenizer, served with the byte tokenizer asked for: it takes the config's eos/bos ids, and the
engine stops there. (Not asking for it is an error: tests/serve/test_kimi_tokenizer.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.loading import ASSETS, build_model, model_tokenizer
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

EOS, BOS = 300, 301


def folder_without_tokenizer(tmp_path: Path, eos: int | None = EOS, bos: int | None = BOS) -> Path:
    config = json.loads((ASSETS / "tiny" / "config.json").read_text())
    config.update(eos_token_id=eos, bos_token_id=bos)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(ASSETS / "tiny" / "model.safetensors")
    return tmp_path


def test_the_configs_ids_win_over_the_fallbacks(tmp_path: Path) -> None:
    tok = model_tokenizer(folder_without_tokenizer(tmp_path), seed=0, byte_tokenizer=True)
    assert isinstance(tok, ByteTokenizer)
    assert (tok.eos_token_id, tok.bos_token_id) == (EOS, BOS)
    assert tok.encode("a", add_special_tokens=True) == [BOS, ord("a")]
    assert tok.decode([ord("a"), EOS]) == "a"


def test_an_unset_id_keeps_the_fallbacks(tmp_path: Path) -> None:
    tok = model_tokenizer(folder_without_tokenizer(tmp_path, eos=EOS, bos=None), seed=0, byte_tokenizer=True)
    fallback = ByteTokenizer(4096)
    assert (tok.eos_token_id, tok.bos_token_id) == (EOS, fallback.bos_token_id)


def test_the_engine_stops_at_the_configs_eos(tmp_path: Path) -> None:
    model, tok = build_model(folder_without_tokenizer(tmp_path), torch.float32, "cpu", seed=0, byte_tokenizer=True)
    engine = LLMEngine(model, tok, EngineConfig(max_model_len=64, num_pages=16, max_num_seqs=2))
    engine.add_request("r", [ord("a")], SamplingParams(max_tokens=4))
    assert EOS in engine.scheduler.requests["r"].stop_token_ids
    assert ByteTokenizer(4096).eos_token_id not in engine.scheduler.requests["r"].stop_token_ids


def test_generation_configs_eos_and_defaults_hold_with_a_tokenizer_passed_apart(tmp_path: Path) -> None:
    """generation_config.json's eos ids end every generation (masked until min_tokens, ended as EOS, stop_reason None) even
    when the caller brings its own tokenizer, and its sampling values are what generate() uses without SamplingParams."""
    from openk3.llm import LLM

    folder = folder_without_tokenizer(tmp_path)
    gen = {"eos_token_id": [EOS, 302], "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3, "do_sample": True, "transformers_version": "4"}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(folder, ByteTokenizer(4096), max_model_len=64, num_pages=16, max_num_seqs=2)
    try:
        assert llm.default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, max_tokens=3)
        llm.engine.add_request("r", [ord("a")], SamplingParams(max_tokens=4, min_tokens=2))
        req = llm.engine.scheduler.requests["r"]
        assert {EOS, 302, ByteTokenizer(4096).eos_token_id} <= req.stop_token_ids
        req.append_output(302)
        from openk3.serve.stopping import token_stop

        assert token_stop(req, 302, 64, llm.engine._eos) is None  # min_tokens=2: not yet (and the sampler masks it)
        req.append_output(302)
        assert token_stop(req, 302, 64, llm.engine._eos) is not None and req.stop_reason is None
    finally:
        llm.close()


def test_a_bad_generation_config_names_the_key(tmp_path: Path) -> None:
    from openk3.serve.generation_config import read_generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        read_generation_config(tmp_path)


def test_every_file_of_a_release_folder_is_named_with_what_serves_it(tmp_path: Path) -> None:
    from openk3.serve.folder_files import folder_files

    for name in ("config.json", "encoding_k3.py", "tokenization_kimi.py", "kimi_k3_processor.py", "model-00001-of-00002.safetensors", "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (tmp_path / "extras").mkdir()
    said = dict(folder_files(tmp_path))
    assert "EAGLE-3 draft head" in said["eagle3/"] and said["extras/"] == "not read with the model: a subfolder"
    assert "api/k3_encoding.py" in said["encoding_k3.py"] and "serve/kimi_tokenizer.py" in said["tokenization_kimi.py"]
    assert "serve/vision_processor.py" in said["kimi_k3_processor.py"] and said["notes.txt"].startswith("skipped")
    assert "1 safetensors shard(s)" in said


def test_without_a_tokenizer_the_error_names_only_options_that_exist(tmp_path: Path) -> None:
    from openk3.serve.tokenizer import TokenizerNotFoundError

    with pytest.raises(TokenizerNotFoundError, match="--tokenizer byte") as e:
        model_tokenizer(folder_without_tokenizer(tmp_path), seed=0)
    assert "byte_tokenizer=True" not in str(e.value)
