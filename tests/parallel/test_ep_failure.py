"""Expert-parallel failures: a step that raises on rank 0, a worker that cannot build its model, arguments refused early.

A failed step leaves the workers inside that step's collectives, so close() must not send STOP (they cannot read it) but
tear the group down; these tests bound how long that takes and check that no worker is left behind.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.model.weights import save_model
from openk3.parallel.serving.driver import EPDriver
from openk3.parallel.serving.local import LocalEP
from openk3.parallel.serving.spawned import RankStartError, SpawnedRanks, report_error, report_started
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CLOSE_WITHIN_S = 20.0


class RaiseOnCall:
    """Wraps a model; the `fail_at`-th call (1-based) raises, as an out-of-memory error inside a forward would."""

    def __init__(self, model, fail_at: int) -> None:  # noqa: ANN001  # any ForwardModel
        self.model, self.fail_at, self.calls = model, fail_at, 0
        self.config = model.config

    def __call__(self, batch: ForwardBatch, cache: CacheTensors | None) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure inside the forward")
        return self.model(batch, cache)

    def parameters(self, recurse: bool = True):  # noqa: ANN201
        return self.model.parameters(recurse)


class RecordingChannel:
    """A StepChannel stand-in for one process: records what the driver would broadcast."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    encode_step = staticmethod(lambda batch: ([1], torch.zeros(1)))

    def send_cache(self, cache: CacheTensors) -> None:
        self.sent.append("cache")

    def send_encoded(self, header: list[int], payload: torch.Tensor) -> None:
        self.sent.append("step")

    def send_stop(self) -> None:
        self.sent.append("stop")


def test_driver_after_a_failed_step_refuses_calls_and_sends_no_stop() -> None:
    model = K3ForCausalLM(debug())
    model.init_weights(0)
    channel = RecordingChannel()
    driver = EPDriver(RaiseOnCall(model, fail_at=2), channel)  # type: ignore[arg-type]
    cache = CacheTensors.allocate(debug(), num_slots=2, num_pages=4, page_size=4, dtype=torch.float32)
    batch = ForwardBatch.for_step([[1, 2, 3]], [0], [0], torch.tensor([[0]]))
    with torch.inference_mode():
        driver(batch, cache)
        with pytest.raises(RuntimeError, match="injected failure"):
            driver(batch, cache)
        assert driver.failed
        with pytest.raises(RuntimeError, match="an earlier step failed .*injected failure"):
            driver(batch, cache)
    driver.close()
    assert channel.sent == ["cache", "step", "step"], "no STOP after a failed step, and nothing after the failure"
    assert driver.closed


def close_within(llm: LLM, seconds: float) -> float:
    """Run llm.close() in a thread; fail if it has not returned after `seconds` (the workers are then killed by pid)."""
    done = threading.Event()
    error: list[BaseException] = []

    def target() -> None:
        try:
            llm.close()
        except BaseException as e:  # re-raised below, on the test's thread
            error.append(e)
        done.set()

    start = time.monotonic()
    threading.Thread(target=target, daemon=True).start()
    finished = done.wait(seconds)
    elapsed = time.monotonic() - start
    if not finished:
        for w in llm._ep.workers:  # type: ignore[union-attr]
            w.kill()
        pytest.fail(f"close() still blocked after {seconds} s")
    if error:
        raise error[0]
    return elapsed


@pytest.mark.distributed
def test_failed_step_on_rank0_close_tears_down_promptly() -> None:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("debug", ep=2, ep_method="ep")
    ep = llm._ep
    assert ep is not None and ep.driver is not None
    ep.driver.model = RaiseOnCall(ep.driver.model, fail_at=3)  # after the step's broadcast: the worker is inside it
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate([[1, 2, 3]], GREEDY)
    with pytest.raises(RuntimeError, match="an earlier step failed"):
        llm.generate([[4, 5]], GREEDY)
    close_within(llm, CLOSE_WITHIN_S)
    assert not any(w.is_alive() for w in ep.workers), "every worker is gone"
    assert not dist.is_initialized(), "rank 0 left the process group"
    llm.close()  # idempotent


@pytest.fixture(scope="module")
def checkpoint_missing_rank1_expert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint that lacks expert 7 of layer 1: rank 1 (experts 4..7 with ep/moonep) fails to load, rank 0 does not."""
    model = K3ForCausalLM(debug())
    model.init_weights(seed=1, std=0.1)
    folder = tmp_path_factory.mktemp("broken")
    save_model(model, folder)
    file = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if not k.startswith("model.layers.1.block_sparse_moe.experts.7.")}
    save_file(tensors, file)
    return folder


@pytest.mark.distributed
def test_worker_failing_at_start_up_is_reported_by_llm(checkpoint_missing_rank1_expert: Path) -> None:
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError, match=r"(?s)start-up failed on 1 rank\(s\): rank 1: CheckpointError: .*missing experts \[7\]"):
        LLM(str(checkpoint_missing_rank1_expert), ByteTokenizer(256), ep=2, ep_method="ep")  # it ships no tokenizer
    assert not dist.is_initialized()


@pytest.mark.distributed
def test_rank0_failing_at_start_up_raises_its_own_error_and_releases_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    workers: list = []
    real_teardown = LocalEP._teardown

    def spy(self: LocalEP, grace_s: float) -> None:  # to see the spawned workers of an LLM that never exists
        workers.extend(self.workers)
        real_teardown(self, grace_s)

    monkeypatch.setattr(LocalEP, "_teardown", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="8 experts to split evenly over ep=3"):  # every rank fails the same way
            LLM("debug", ep=3, ep_method="ep")
    assert len(workers) == 2 and all(w.exitcode is not None for w in workers), "the workers left after the handshake"
    assert not dist.is_initialized()


def test_ep_refuses_early() -> None:
    class NotK3(torch.nn.Module):
        config = debug()

    with pytest.raises(ValueError, match="must be a K3ForCausalLM .* got NotK3"):
        LLM(NotK3(), ep=2)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"device='cuda:0' with ep=2: .*name no index"):
        warnings.simplefilter("ignore")
        LLM("debug", ep=2, device="cuda:0")
    from openk3.cli import build_parser
    from openk3.launch.server import server_configs

    args = build_parser().parse_args(["serve", "--ep", "2", "--ep-method", "ep", "--device", "cuda:1"])
    with pytest.raises(ValueError, match="device='cuda:1' with ep=2: .*name no index"):  # the same check as LLM's, before any rank starts
        server_configs(args)
    server_configs(build_parser().parse_args(["serve", "--ep", "1", "--device", "cuda:1"]))


def _die_before_starting_the_rank(report: Connection) -> None:
    """A spawned rank that dies as one does in a script without a __main__ guard: before it runs any rank code."""
    raise SystemExit(3)


def _start_then_fail(report: Connection) -> None:
    report_started(report)
    try:
        raise RuntimeError("injected: CUDA out of memory while building the shard")
    except RuntimeError as e:
        report_error(report, e)
        raise SystemExit(1) from e


def test_a_worker_that_dies_at_start_up_is_reported_at_once_with_its_exit_code() -> None:
    """Issue 36 item 3: before, rank 0 waited in init_process_group for a rank that had already died. The wait ends when
    the worker's process does (its sentinel), not on a timer: the deadline given here is never reached."""
    spawn = mp.get_context("spawn")
    read, write = spawn.Pipe(duplex=False)
    worker = spawn.Process(target=_die_before_starting_the_rank, args=(write,), daemon=True)
    worker.start()
    write.close()
    with pytest.raises(RankStartError, match=r"rank 1 \(pid \d+\) exited with code 3 before it reported anything .*__main__"):
        SpawnedRanks([worker], [read]).wait_started(timeout_s=3600)
    worker.join()


def test_a_worker_that_fails_after_starting_is_reported_with_its_last_error() -> None:
    spawn = mp.get_context("spawn")
    read, write = spawn.Pipe(duplex=False)
    worker = spawn.Process(target=_start_then_fail, args=(write,), daemon=True)
    worker.start()
    write.close()
    ranks = SpawnedRanks([worker], [read])
    ranks.wait_started(timeout_s=3600)
    worker.join()
    report = ranks.dead_report()
    assert report is not None and re.fullmatch(r"rank 1 \(pid \d+\) exited with code 1; its last error: RuntimeError: injected: CUDA out of memory.*", report)


def test_a_worker_that_never_starts_is_reported_at_the_deadline() -> None:
    spawn = mp.get_context("spawn")
    read, write = spawn.Pipe(duplex=False)
    alive, _keep = spawn.Pipe(duplex=False)

    class Silent:  # a stand-in process that neither reports nor ends: its pipe and its sentinel stay silent
        pid, exitcode, sentinel = 0, None, alive

    try:
        with pytest.raises(RankStartError, match=r"rank\(s\) 1 did not start within 0.05 s"):
            SpawnedRanks([Silent()], [read]).wait_started(timeout_s=0.05)  # type: ignore[list-item]
    finally:
        for end in (read, write, alive, _keep):
            end.close()


class StopWorkerOnCall:
    """Wraps rank 0's model; the `at`-th call SIGSTOPs the worker after the step's broadcast, so rank 0's forward waits in
    a collective for a rank that is stopped (alive, silent): only the heartbeat can end the wait before ep_timeout_s."""

    def __init__(self, model, worker_pid: int, at: int) -> None:  # noqa: ANN001  # any ForwardModel
        self.model, self.pid, self.at, self.calls = model, worker_pid, at, 0
        self.config = model.config

    def __call__(self, batch: ForwardBatch, cache: CacheTensors | None) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            os.kill(self.pid, signal.SIGSTOP)
        return self.model(batch, cache)

    def parameters(self, recurse: bool = True):  # noqa: ANN201
        return self.model.parameters(recurse)


@pytest.mark.distributed
def test_a_stopped_worker_fails_the_step_by_its_heartbeat_not_the_group_timeout() -> None:
    """Issue 36 item 2: before, rank 0 waited out ep_timeout_s (300 s by default; here 600 s, which the test would not
    survive); the heartbeat (2 s) finds the stopped worker, LocalEP kills it, and the step fails with a connection error."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("debug", ep=2, ep_method="ep", ep_timeout_s=600, heartbeat_timeout_s=2)
    ep = llm._ep
    assert ep is not None and ep.driver is not None and ep.driver.heartbeat is not None
    worker = ep.workers[0]
    assert worker.pid is not None
    ep.driver.model = StopWorkerOnCall(ep.driver.model, worker.pid, at=2)
    try:
        with pytest.raises(RuntimeError):
            llm.generate([[1, 2, 3]], GREEDY)
        assert ep.driver.heartbeat.lost is not None and ep.driver.failed
        worker.join(CLOSE_WITHIN_S)
        assert worker.exitcode == -signal.SIGKILL, "LocalEP killed the stopped worker"
        close_within(llm, CLOSE_WITHIN_S)
        assert not dist.is_initialized()
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()


@pytest.mark.distributed
def test_a_stopped_data_parallel_rank_fails_the_engine_by_its_heartbeat() -> None:
    """The same with data-parallel attention (dp=2, ep=2): the worker is stopped before the request, so rank 0 learns of
    it from the heartbeat, whether that comes before the step (which then refuses at once) or during it."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("debug", dp=2, ep=2, ep_method="ep", ep_timeout_s=600, heartbeat_timeout_s=2)
    ep = llm._ep
    assert ep is not None and ep.dp_engine is not None and ep.dp_engine.heartbeat is not None
    worker = ep.workers[0]
    assert worker.pid is not None
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(RuntimeError):
            llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)
        assert ep.dp_engine.heartbeat.lost is not None and ep.dp_engine.failed
        worker.join(CLOSE_WITHIN_S)
        assert worker.exitcode == -signal.SIGKILL, "LocalEP killed the stopped worker"
        close_within(llm, CLOSE_WITHIN_S)
        assert not dist.is_initialized()
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
