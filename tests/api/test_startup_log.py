"""`openk3 serve`'s start-up lines name the model, the context length, the cache budget (pages, tokens, KDA state slots),
the dtype, the parallel layout and the address, from the engine as built (not from the flags' defaults)."""

from __future__ import annotations

import logging

import pytest

from openk3.cli import build_parser
from openk3.launch.server import build_server


@pytest.mark.filterwarnings("ignore:model 'debug'")  # the preset's random weights
def test_the_startup_lines_name_what_an_operator_checks(torch_one_thread, caplog) -> None:
    flags = ["--model", "debug", "--served-model-name", "k3-demo", "--max-model-len", "96", "--max-num-seqs", "3", "--num-pages", "20"]
    args = build_parser().parse_args(["serve", *flags, "--page-size", "8", "--port", "8123", "--host", "127.0.0.1"])
    with caplog.at_level(logging.INFO, logger="openk3.api"):
        app = build_server(args)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "openk3.api")
    engine = app.state.served.frontend.engine
    mla = len(engine.model_config.mla_layers)
    assert f"model 'k3-demo' from debug: {engine.model_config.num_hidden_layers} layers ({mla} MLA" in text
    assert "weights float32 on cpu" in text
    assert "context length (max_model_len) 96 tokens; at most 3 running requests" in text
    assert "cache: 20 MLA pages x 8 tokens = 160 tokens, 3 KDA state slots" in text and "dtype float32; prefix caching off" in text
    assert "parallel layout: tp=1 ep=1 dp=1 (1 rank; 1 engine)" in text
    assert "serving on http://127.0.0.1:8123" in text
