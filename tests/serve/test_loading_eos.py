"""A checkpoint folder without a tokenizer, served with the byte tokenizer asked for: it takes the config's eos/bos ids, and the
engine stops there. (Not asking for it is an error: tests/serve/test_kimi_tokenizer.py.)"""

from __future__ import annotations

import json
from pathlib import Path

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
