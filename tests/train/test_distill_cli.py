"""`openk3 distill` end to end on two tiny teachers of different widths (model folders with their tokenizer): score a store,
train a student from it, continue it on-policy from that checkpoint; and a teacher with another tokenizer is refused."""

import json

import pytest
import torch

from openk3.cli import main
from openk3.model import K3ForCausalLM
from openk3.model.weights import save_model
from openk3.train.data import domain_documents
from openk3.train.distill_cli import width_config
from openk3.train.teacher_store import read_layout
from openk3.train.teachers import TokenizerMismatch
from openk3.train.tokenizer import save_tokenizer, train_tokenizer


def teacher_folder(path, tok, width: int, seed: int) -> str:
    model = K3ForCausalLM(width_config(width, tok.get_vocab_size()))
    model.init_weights(seed=seed)
    save_model(model.eval(), path)
    save_tokenizer(tok, path)
    return str(path)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return domain_documents("kjv")[0][:20] + domain_documents("python")[0][:5]


def test_score_train_on_policy(tmp_path, texts) -> None:
    torch.manual_seed(0)
    tok = train_tokenizer(texts, 320)
    a = teacher_folder(tmp_path / "a", tok, 32, 1)
    b = teacher_folder(tmp_path / "b", tok, 16, 2)
    teachers = ["--teacher", f"bible={a}", "--teacher", f"code={b}", "--route", "kjv=bible", "--route", "python=code"]
    store = tmp_path / "store"
    assert main(["distill", "score", *teachers, "--windows", "3", "--seq-len", "12", "--k", "8", "--store", str(store)]) == 0
    layout = read_layout(store)
    assert (layout.k, layout.seq_len, layout.domains, layout.teachers, layout.num_windows) == (8, 12, ("kjv", "python"), ("bible", "code"), 6)
    run = tmp_path / "student"
    common = ["--width", "16", "--batch-size", "2", "--eval-windows", "2", "--warmup", "0"]
    assert main(["distill", "train", "--store", str(store), *common, "--steps", "2", "--kl", "reverse", "--out", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["held_out_ppl_kjv"] > 1 and (run / "model" / "config.json").is_file()
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert all("kl" in r and "ce" in r for r in log)
    on = tmp_path / "on-policy"
    args = [*teachers, "--tokenizer", str(store / "tokenizer"), *common, "--steps", "1", "--prompt-len", "4", "--sample-len", "4", "--k", "8"]
    assert main(["distill", "on-policy", *args, "--init", str(run / "checkpoint.pt"), "--out", str(on)]) == 0
    rec = json.loads((on / "log.jsonl").read_text().splitlines()[-1])
    assert rec["weight_version"] == 2 and rec["sampled_tokens"] == 2 * 4  # the initial weights, then the step's


def test_teachers_with_different_tokenizers_are_refused(tmp_path, texts) -> None:
    a = teacher_folder(tmp_path / "a", train_tokenizer(texts, 320), 16, 1)
    b = teacher_folder(tmp_path / "b", train_tokenizer(texts[:3], 320), 16, 2)
    with pytest.raises(TokenizerMismatch, match="'bible' and 'code' do not share a tokenizer"):
        main(["distill", "score", "--teacher", f"bible={a}", "--teacher", f"code={b}", "--route", "kjv=bible", "--store", str(tmp_path / "s")])
