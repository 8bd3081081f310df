"""`--dataset sharegpt`: the loader (first human turn + the gpt reply), vLLM's length filter, oversampling, and a run against the
fake server, whose /tokenize counts one token a word. The sample file is hand-written in the ShareGPT format for these tests."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from openk3.api.bench import run_cli
from openk3.api.bench_data import DatasetConfig, load_sharegpt, sharegpt_fits, sharegpt_requests
from tests.api.test_bench_client import FakeClock, FakeServer, bench_args, run_fake

SAMPLE = str(Path(__file__).parent / "data" / "sharegpt_sample.json")
SKY = "Explain in two sentences why the sky looks blue during the day."  # 12 words, its reply 32
HAIKU = "Write a haiku about autumn leaves falling in the rain."  # 10 words (after a gpt greeting), its reply 16
HI = "Hi there"  # 2 words: too short
PARIS = "What is the capital city of France?"  # 7 words, its reply 1: too short unless the output length is fixed


async def words(texts: list[str], special: bool) -> list[int]:
    return [len(t.split()) for t in texts]


def requests(num: int, output_len: int | None = None, seed: int = 0, path: str = SAMPLE):
    cfg = DatasetConfig("sharegpt", num, seed=seed, dataset_path=path, sharegpt_output_len=output_len)
    return asyncio.run(sharegpt_requests(cfg, words))


def test_loader_takes_the_first_human_turn_and_its_reply_shuffled_with_the_seed() -> None:
    pairs = load_sharegpt(SAMPLE, seed=0)
    assert {p for p, _ in pairs} == {SKY, HAIKU, HI, PARIS}  # no reply (5) or a human turn after a human turn (6): skipped
    assert dict(pairs)[HAIKU].startswith("Red leaves") and dict(pairs)[PARIS] == "Paris."
    in_file_order = [SKY, HAIKU, HI, PARIS]
    random.Random(7).shuffle(in_file_order)
    assert [p for p, _ in load_sharegpt(SAMPLE, seed=7)] == in_file_order


def test_length_filter_is_vllms() -> None:
    assert sharegpt_fits(4, 4, False) and sharegpt_fits(1024, 1024, False)
    assert not sharegpt_fits(3, 100, False) and not sharegpt_fits(100, 3, False) and sharegpt_fits(100, 3, True)
    assert not sharegpt_fits(1025, 4, False) and not sharegpt_fits(1024, 1025, False) and not sharegpt_fits(3, 10, True)


def test_requests_keep_what_fits_with_reply_lengths_and_oversample() -> None:
    got = requests(2)
    assert {(r.prompt, r.output_len, r.input_len) for r in got} == {(SKY, 32, 12), (HAIKU, 16, 10)}
    five = requests(5)
    assert len(five) == 5 and {r.prompt for r in five} == {SKY, HAIKU} and five == requests(5)  # seeded repeats
    fixed = requests(3, output_len=6)
    assert {r.prompt for r in fixed} == {SKY, HAIKU, PARIS} and {r.output_len for r in fixed} == {6}


def test_bad_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="No such file"):
        requests(1, path=str(tmp_path / "missing.json"))
    (tmp_path / "dict.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        requests(1, path=str(tmp_path / "dict.json"))
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ValueError, match="not a JSON file"):
        requests(1, path=str(tmp_path / "bad.json"))
    long = [{"conversations": [{"from": "human", "value": "w " * 1025}, {"from": "gpt", "value": "a b c d e"}]}]
    (tmp_path / "long.json").write_text(json.dumps(long))
    with pytest.raises(ValueError, match="no conversation fits"):
        requests(1, path=str(tmp_path / "long.json"))


def test_sharegpt_run_against_the_fake_server() -> None:
    clock = FakeClock()
    server = FakeServer(clock)
    r = run_fake(server, clock, "--dataset", "sharegpt", "--dataset-path", SAMPLE, "--num-prompts", "2")
    assert {(p["prompt"], p["max_tokens"]) for p in server.payloads} == {(SKY, 32), (HAIKU, 16)}
    assert r["completed"] == 2 and r["total_input_tokens"] == 22 and r["total_output_tokens"] == 48
    assert sorted(r["input_lens"]) == [10, 12] and r["dataset_config"]["dataset_path"] == SAMPLE
    counted = {(t["prompt"], t["add_special_tokens"]) for t in server.tokenized}
    assert (SKY, True) in counted and (dict(load_sharegpt(SAMPLE, 0))[SKY], False) in counted  # replies without specials


def test_sharegpt_needs_the_servers_tokenize(capsys) -> None:
    server = FakeServer(FakeClock(), tokenize=False)
    assert run_cli(bench_args("--dataset", "sharegpt", "--dataset-path", SAMPLE), server.transport()) == 1
    err = capsys.readouterr().err
    assert "/tokenize, which answered HTTP 404" in err and err.count("\n") == 1 and not server.payloads
