"""`openk3 serve --ops` (and `openk3 generate --ops`): the flag reaches the engine's model, and a bad one ends the command
with one line and exit 2 before any model is built."""

from __future__ import annotations

import pytest

from openk3.cli import build_parser
from openk3.launch import cli
from openk3.launch.server import build_server
from openk3.model import K3ForCausalLM
from openk3.model.moe import LocalExperts
from openk3.ops.registry import op

SMALL = ["--model", "debug", "--max-model-len", "64", "--max-num-seqs", "2"]


@pytest.mark.filterwarnings("ignore:model 'debug'")  # the preset's random weights
def test_the_flag_reaches_the_engines_model(torch_one_thread) -> None:
    app = build_server(build_parser().parse_args(["serve", *SMALL, "--ops", "moe=naive, kda=naive"]))
    engine = app.state.served.frontend.engine
    assert engine.config.ops == "kda=naive,moe=naive"
    model = engine.model
    assert isinstance(model, K3ForCausalLM) and (model.ops.kda, model.ops.moe) == ("naive", "naive")
    assert all(isinstance(m.backend, LocalExperts) and m.backend.op is op("moe_experts", "naive") for m in model.moe_layers())
    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--ops", "kda=naive"])
    assert generate.ops == "kda=naive"


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ("kda=fla", "kda='fla' cannot run on cpu float32: expected one of autograd, fast, mixed, naive, auto"),
        ("kda=fla,kda=naive", "kda is named twice"),
        ("packed_experts=1", "packed_experts cannot be named"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2_before_the_model_is_built(ops: str, message: str, monkeypatch, capsys) -> None:
    def never(*args: object) -> None:
        raise AssertionError("the server was built")

    monkeypatch.setattr(cli, "build_server", never)
    assert cli.run(build_parser().parse_args(["serve", *SMALL, "--ops", ops])) == 2
    err = capsys.readouterr().err
    assert err.startswith("openk3 serve: EngineConfig.ops: ") and message in err and err.count("\n") == 1
