"""`openk3 bench serve` against a fake server (an httpx MockTransport) in fake time: errors, percentiles, arrivals, ignore_eos,
peak throughput and the per-request arrays. The fake clock moves only when the fake server streams or the benchmark sleeps."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
from itertools import accumulate

import httpx
import pytest

from openk3.api.bench import add_arguments, benchmark, run_cli
from openk3.api.bench_args import base_url
from openk3.api.bench_data import arrival_intervals
from openk3.api.bench_metrics import RequestResult, format_table, peaks, summarize


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        await asyncio.sleep(0)  # the request just created runs up to its first await (it reads the clock there)
        self.now += dt


class FakeServer:
    """Streams max_tokens chunks of one token: the first `ttft` after the send, then one every `gap` (fake seconds)."""

    def __init__(self, clock: FakeClock, status: int = 200, ttft: float = 0.5, gap: float = 0.25, tokenize: bool = True, interleave: bool = False) -> None:
        self.clock, self.status, self.ttft, self.gap, self.tokenize = clock, status, ttft, gap, tokenize
        self.interleave = interleave  # let other streams run between chunks (else each stream runs to its end at once)
        self.payloads: list[dict] = []
        self.tokenized: list[dict] = []
        self.paths: list[str] = []
        self.in_flight = self.most_in_flight = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        if path == "/tokenize":
            if not self.tokenize:
                return httpx.Response(404, json={"detail": "Not Found"})
            self.tokenized.append(body)
            ids = [len(w) for w in body["prompt"].split()]  # one token a word
            return httpx.Response(200, json={"tokens": ids, "count": len(ids)})
        if path == "/detokenize":
            return httpx.Response(200, json={"prompt": " ".join("w" * n for n in body["tokens"])})
        self.payloads.append(body)
        self.paths.append(path)
        if self.status != 200:
            return httpx.Response(self.status, text="boom")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream(body))

    async def stream(self, body: dict):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            chat = "messages" in body
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            n = body["max_completion_tokens" if chat else "max_tokens"]
            if chat:
                yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}).encode() + b"\n\n"
            for i in range(n):
                self.clock.now += self.ttft if i == 0 else self.gap
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
                if self.interleave:
                    await asyncio.sleep(0)
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()), "completion_tokens": n}
        finally:
            self.in_flight -= 1  # here, not after [DONE]: the client stops reading there, and this generator is never resumed
        yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--base-url", "http://fake", "--disable-tqdm", "--num-prompts", "3", "--input-len", "8", "--output-len", "5", *argv])


def run_fake(server: FakeServer, clock: FakeClock, *argv: str) -> dict:
    return asyncio.run(benchmark(bench_args(*argv), server.transport(), clock, clock.sleep))


def test_unreachable_server_is_one_clear_line(capsys) -> None:
    with socket.socket() as closed:  # bound but not listening: connecting is refused, and no one else can take the port
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        for extra in ([], ["--model", "m"]):
            args = bench_args("--base-url", f"http://127.0.0.1:{port}", *extra)
            assert run_cli(args) == 1
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1, err
            assert f"cannot reach the server at http://127.0.0.1:{port}" in err and "Traceback" not in err


def test_all_failed_run_prints_na_and_exits_nonzero(tmp_path, capsys) -> None:
    clock = FakeClock()
    server = FakeServer(clock, status=500)
    out_file = tmp_path / "r.json"
    assert run_cli(bench_args("--save-result", str(out_file), "--goodput", "ttft:100"), server.transport()) == 1
    out, err = capsys.readouterr()
    assert len(server.payloads) == 3
    for label in ("Mean TTFT (ms)", "P99 ITL (ms)", "Request throughput (req/s)", "Request goodput (req/s)", "Peak output token throughput (tok/s)"):
        assert next(line for line in out.splitlines() if line.startswith(label)).split(":")[1].strip() == "N/A", label
    assert "Successful requests:" in out and "all 3 requests failed" in err and "error: HTTP 500: b'boom'" in err
    saved = json.loads(out_file.read_text())
    assert saved["completed"] == 0 and saved["failed"] == 3
    assert saved["mean_ttft_ms"] is None and saved["output_throughput"] is None and saved["max_output_tokens_per_s"] is None
    assert saved["errors"] == ["HTTP 500: b'boom'"] * 3 and saved["ttfts"] == [0.0] * 3 and saved["input_lens"] == [8] * 3


def test_timings_percentiles_peak_and_arrays_in_fake_time(tmp_path, capsys) -> None:
    clock = FakeClock()
    server = FakeServer(clock)
    r = run_fake(server, clock, "--max-concurrency", "1", "--metric-percentiles", "50,90,99.9", "--percentile-metrics", "ttft,e2el")
    assert r["completed"] == 3 and r["duration"] == 4.5  # three requests of 0.5 + 4 x 0.25 s, one after another
    assert r["ttfts"] == [0.5] * 3 and r["itls"] == [[0.25] * 4] * 3 and r["e2els"] == [1.5] * 3
    assert r["start_times"] == [0.0, 1.5, 3.0] and r["input_lens"] == [8] * 3 and r["output_lens"] == [5] * 3
    assert r["generated_texts"] == ["xxxxx"] * 3 and r["errors"] == [""] * 3
    assert r["mean_tpot_ms"] == 250.0 and r["p50_ttft_ms"] == 500.0 and r["p90_itl_ms"] == 250.0 and r["p99.9_e2el_ms"] == 1500.0
    assert "p99_ttft_ms" not in r
    # tokens land at 100.5, 100.75, 101, 101.25, 101.5 | 102 ... 103 | 103.5 ... 104.5: the window [102, 103) holds four
    assert r["max_output_tokens_per_s"] == 4.0 and r["max_concurrent_requests"] == 1  # one after another: never two at once
    assert r["output_throughput"] == pytest.approx(15 / 4.5)
    for p in server.payloads:  # greedy, streamed, ignore_eos on by default
        assert (p["temperature"], p["stream"], p["ignore_eos"], p["max_tokens"], p["model"]) == (0.0, True, True, 5, "fake-model")

    assert run_cli(bench_args("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90"), FakeServer(FakeClock()).transport()) == 0
    table = capsys.readouterr().out
    assert "P50 TTFT (ms)" in table and "P90 E2EL (ms)" in table and "Median E2EL (ms)" in table
    assert "TPOT" not in table and "ITL" not in table and "P99" not in table


def test_ignore_eos_is_on_by_default_and_can_be_turned_off() -> None:
    sent = {}
    for flag, expected in (([], True), (["--ignore-eos"], True), (["--no-ignore-eos"], False)):
        clock = FakeClock()
        server = FakeServer(clock)
        result = run_fake(server, clock, *flag)
        sent[expected] = {p["ignore_eos"] for p in server.payloads}
        assert result["ignore_eos"] is expected and sent[expected] == {expected}


def test_arrivals_are_seeded_gamma_with_mean_one_over_rate() -> None:
    assert arrival_intervals(50, 4.0, 0.5, seed=1) == arrival_intervals(50, 4.0, 0.5, seed=1) != arrival_intervals(50, 4.0, 0.5, seed=2)
    for burstiness in (0.25, 1.0, 4.0):
        gaps = arrival_intervals(4001, 4.0, burstiness, seed=0)
        assert len(gaps) == 4000 and statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
        # gamma(shape k): coefficient of variation 1 / sqrt(k); 1 for the Poisson process (exponential gaps)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness**-0.5, rel=0.1)
    assert arrival_intervals(4, float("inf"), 1.0, seed=0) == [0.0] * 3
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, float("inf")), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="request-rate"):
            arrival_intervals(3, rate, burstiness, seed=0)


def test_the_benchmark_sleeps_the_seeded_gaps_between_sends() -> None:
    clock = FakeClock()
    server = FakeServer(clock, ttft=0.0, gap=0.0)  # answers take no time: only the sleeps move the clock
    r = run_fake(server, clock, "--num-prompts", "5", "--request-rate", "2", "--burstiness", "0.5", "--seed", "3")
    gaps = arrival_intervals(5, 2.0, 0.5, seed=3)
    assert clock.sleeps == gaps and r["burstiness"] == 0.5
    assert r["start_times"] == pytest.approx([0.0, *accumulate(gaps)])
    assert r["duration"] == pytest.approx(sum(gaps))


def test_peaks_count_tokens_per_one_second_window() -> None:
    results = [
        RequestResult(True, 4, 4, ttft=0.1, latency=0.8, itl=[0.2] * 3, start=10.0, end=10.8),  # tokens at 10.1 .. 10.7: window 0
        RequestResult(True, 4, 6, ttft=0.6, latency=0.9, itl=[0.1, 0.1], start=10.5, end=11.4),  # 3 chunks of 2 tokens at 11.1 .. 11.3: window 1
        RequestResult(False, 4, error="HTTP 500", start=9.0, end=9.1),  # failed: neither the windows' origin nor their counts
    ]
    assert peaks(results) == (6.0, 2)  # both requests are in flight from 10.5 to 10.8
    s = summarize(results, duration=2.0, slos={})
    assert s["max_output_tokens_per_s"] == 6.0 and s["max_concurrent_requests"] == 2 and s["output_throughput"] == 5.0
    assert s["start_times"] == [1.0, 1.5, 0.0] and s["output_lens"] == [4, 6, 0] and s["errors"] == ["", "", "HTTP 500"]
    assert peaks([RequestResult(False, error="x")]) == (None, None)  # never sent
    assert peaks([RequestResult(False, error="x", start=1.0, end=2.0)]) == (None, 1)  # failed, but it was in flight


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
        (["--metric-percentiles", "50,101"], "--metric-percentiles"),
        (["--burstiness", "0"], "--burstiness"),
        (["--dataset", "sharegpt"], "--dataset-path"),
    ],
)
def test_bad_arguments_exit_2_before_any_request(argv, message, capsys) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"the server was asked {request.url}")

    assert run_cli(bench_args(*argv), httpx.MockTransport(refuse)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_vllm_bench_serve_flag_names_are_accepted() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    vllm = parser.parse_args(["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "7", "--random-range-ratio", "0.5"])
    ours = parser.parse_args(["--dataset", "random", "--input-len", "32", "--output-len", "7", "--range-ratio", "0.5"])
    assert vars(vllm) == vars(ours)


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_peak_concurrent_requests_never_exceeds_max_concurrency(cap: int) -> None:
    """Requests end and the next start within the same fake second: vLLM's per-second windows would count both; the exact
    peak is the cap, and the fake server saw no more in flight."""
    clock = FakeClock()
    server = FakeServer(clock, ttft=0.3, gap=0.1, interleave=True)
    r = run_fake(server, clock, "--num-prompts", "9", "--max-concurrency", str(cap))
    assert r["completed"] == 9 and server.most_in_flight == cap
    assert r["max_concurrent_requests"] == cap
    table = format_table(r, ["ttft"])
    assert f"{'Peak concurrent requests:':<40} {cap}" in table.splitlines()


def test_the_chat_backend_benchmarks_the_chat_route() -> None:
    clock = FakeClock()
    server = FakeServer(clock)
    r = run_fake(server, clock, "--backend", "openai-chat", "--max-concurrency", "1")
    assert server.paths == ["/v1/chat/completions"] * 3 and r["endpoint"] == "/v1/chat/completions" and r["backend"] == "openai-chat"
    for p in server.payloads:  # one user message: the random prompt's token ids spelled out by /detokenize
        (message,) = p["messages"]
        assert message["role"] == "user" and len(message["content"].split()) == 8 and p["max_completion_tokens"] == 5
    # the role chunk is not a token: TTFT is the first content chunk's, and every request made its 5 tokens
    assert r["ttfts"] == [0.5] * 3 and r["output_lens"] == [5] * 3 and r["generated_texts"] == ["xxxxx"] * 3


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "must end with chat/completions"),
        (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "not chat/completions"),
        (["--metadata", "novalue"], "KEY=VALUE"),
    ],
)
def test_an_endpoint_that_does_not_match_the_backend_exits_2(argv, says, capsys) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"the server was asked {request.url}")

    assert run_cli(bench_args(*argv), httpx.MockTransport(refuse)) == 2
    assert says in capsys.readouterr().err


def test_a_vllm_bench_serve_command_line_runs_unchanged_and_saves_vllms_result_file(tmp_path, monkeypatch, capsys) -> None:
    """The flags of a `vllm bench serve` command line, as its docs show them; the file lands where vLLM would put it, under
    vLLM's name, with vLLM's fields."""
    monkeypatch.chdir(tmp_path)
    argv = "--backend openai --host fake --port 8000 --endpoint /v1/completions --model fake-model --tokenizer org/tok"
    argv += " --dataset-name random --random-input-len 8 --random-output-len 5 --num-prompts 4 --max-concurrency 2"
    argv += " --request-rate inf --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --save-detailed"
    argv += " --result-dir out --metadata run=nightly --disable-tqdm --seed 1"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv.split())
    clock = FakeClock()
    server = FakeServer(clock)
    assert base_url(args) == "http://fake:8000"
    assert run_cli(args, server.transport()) == 0
    (saved,) = (tmp_path / "out").iterdir()
    result = json.loads(saved.read_text())
    assert re.fullmatch(r"openai-infqps-concurrency2-fake-model-\d{8}-\d{6}\.json", saved.name), saved.name
    assert saved.name.endswith(result["date"] + ".json") and result["run"] == "nightly"
    head = {k: result[k] for k in ("backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "max_concurrency", "burstiness")}
    assert head == {
        "backend": "openai",
        "model_id": "fake-model",
        "tokenizer_id": "org/tok",
        "num_prompts": 4,
        "request_rate": "inf",
        "max_concurrency": 2,
        "burstiness": 1.0,
    }
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput"):
        assert isinstance(result[key], (int, float)), key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert isinstance(result[f"{stat}_{metric}_ms"], float), (stat, metric)
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        assert len(result[key]) == 4, key
    assert result["completed"] == 4 and 1 <= result["max_concurrent_requests"] <= 2
    assert "results saved to out/" in capsys.readouterr().err
