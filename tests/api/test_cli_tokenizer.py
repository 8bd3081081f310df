"""`openk3 serve --tokenizer byte`: the byte tokenizer only when asked for; a folder without a tokenizer is otherwise an error."""

from __future__ import annotations

import pytest

from openk3.cli import build_parser
from openk3.launch.server import build_server
from openk3.serve.tokenizer import ByteTokenizer, TokenizerNotFoundError
from tests.serve.test_loading_eos import EOS, folder_without_tokenizer


def test_the_byte_tokenizer_is_served_only_when_asked_for(tmp_path, torch_one_thread) -> None:
    folder = str(folder_without_tokenizer(tmp_path))
    base = ["serve", "--model", folder, "--max-model-len", "64", "--max-num-seqs", "2"]
    with pytest.raises(TokenizerNotFoundError, match="tokenizer.json"):
        build_server(build_parser().parse_args(base))
    app = build_server(build_parser().parse_args([*base, "--tokenizer", "byte"]))
    tokenizer = app.state.served.tokenizer
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.eos_token_id == EOS
    assert build_parser().parse_args(["serve"]).tokenizer == "auto"
