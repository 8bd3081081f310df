"""The RL weight routes (api/routes/weights.py) on a live server: an update from a folder under --weight-update-root and
one over a trainer's gloo group each make the server answer as a fresh engine of the new weights, with the weight version
in /health and in every response; folders outside the root and the group when not allowed are refused; a request in
flight during an update finishes on the old weights (drain) or is aborted (abort_running), never mixing the two."""

from __future__ import annotations

import asyncio
import copy
import os
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import torch

from openk3.api.routes.state import WeightUpdateConfig
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.weights import save_model
from openk3.parallel.weight_group import WeightGroup, specs_of
from openk3.parallel.weight_update import update_engine_weights
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.api.conftest import GatedStep, LiveServer, start_server, stop_server
from tests.api.test_bad_input import error_of
from tests.api.test_stream_usage import events

PROMPT = list(range(40, 71))
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def gated(torch_one_thread, root) -> Iterator[tuple[LiveServer, list[GatedStep]]]:
    steps: list[GatedStep] = []
    server = start_server(before_start=lambda e: steps.append(GatedStep(e)), server={"weight_updates": WeightUpdateConfig(root, True)})
    yield server, steps
    stop_server(server)


def new_model(live: LiveServer, seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(live.frontend.engine.model_config)
    m.init_weights(seed=seed)
    return m.eval()


def greedy(m: K3ForCausalLM) -> list[int]:
    llm = LLM(copy.deepcopy(m), ByteTokenizer(256), max_model_len=256, num_pages=256, page_size=8)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    llm.close()
    return list(out.token_ids)


def complete(http: httpx.Client, body: dict = BODY) -> dict:
    r = http.post("/v1/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_update_from_disk_and_over_a_group(gated, root) -> None:
    live, (gate,) = gated
    gate.release.set()  # no holding in this test
    http = httpx.Client(base_url=live.base_url, timeout=120)
    version = http.get("/health").json()["weight_version"]
    disk = new_model(live, 11)
    save_model(disk, os.path.join(root, "step1"))
    r = http.post("/update_weights_from_disk", json={"model_path": os.path.join(root, "step1")})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == version + 1 == http.get("/health").json()["weight_version"]
    choice = complete(http)
    assert choice["token_ids"] == greedy(disk) and choice["weight_version"] == version + 1

    sent = new_model(live, 12)
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sent.state_dict().items()}
    port = free_port()
    trainer: dict[str, WeightGroup] = {}
    joining = threading.Thread(target=lambda: trainer.update(g=WeightGroup("127.0.0.1", port, 0, 2, timeout_s=60)))
    joining.start()
    r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
    joining.join()
    assert r.status_code == 200, r.text
    specs = specs_of(tensors)
    sending = threading.Thread(target=trainer["g"].send, args=(tensors,))
    sending.start()
    body = {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs], "shapes": [list(s.shape) for s in specs]}
    r = http.post("/update_weights_from_distributed", json=body)
    sending.join()
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == version + 2
    with torch.no_grad():  # the engine holds what arrived in bf16
        for name, p in sent.named_parameters():
            p.copy_(tensors[name])
    choice = complete(http)
    assert choice["token_ids"] == greedy(sent) and choice["weight_version"] == version + 2
    assert http.post("/destroy_weights_update_group", json={}).status_code == 200
    trainer["g"].close()
    live.check_idle_and_free()


def test_refusals(gated, root, tmp_path) -> None:
    live, _ = gated
    http = httpx.Client(base_url=live.base_url, timeout=60)
    outside = tmp_path / "elsewhere"
    save_model(new_model(live, 13), outside)
    assert error_of(http.post("/update_weights_from_disk", json={"model_path": str(outside)}), 403)["param"] == "model_path"
    os.symlink(outside, os.path.join(root, "link"))  # a link under the root to a folder outside it
    assert error_of(http.post("/update_weights_from_disk", json={"model_path": os.path.join(root, "link")}), 403)["param"] == "model_path"
    assert error_of(http.post("/update_weights_from_disk", json={"model_path": root, "load_format": "auto"}), 400)
    assert error_of(http.post("/update_weights_from_distributed", json={"names": [], "dtypes": [], "shapes": []}), 400)
    assert error_of(http.post("/destroy_weights_update_group", json={}), 404)


def test_group_and_disk_are_off_by_default(http) -> None:
    assert "--weight-update-root" in error_of(http.post("/update_weights_from_disk", json={"model_path": "/"}), 403)["message"]
    body = {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 2}
    assert "--weight-update-group" in error_of(http.post("/init_weights_update_group", json=body), 403)["message"]


@pytest.mark.parametrize("abort_running", [False, True])
def test_a_request_in_flight_drains_on_the_old_weights_or_is_aborted(gated, abort_running) -> None:
    live, (gate,) = gated
    gate.entered.clear()
    gate.release.clear()
    engine = live.frontend.engine
    version = engine.weight_version
    new = new_model(live, 20 + abort_running).state_dict()
    http = httpx.Client(base_url=live.base_url, timeout=120)
    answer: dict[str, dict] = {}
    body = {**BODY, "max_tokens": 40}
    running = threading.Thread(target=lambda: answer.update(a=complete(http, body)))
    running.start()
    assert gate.entered.wait(60)  # the request is in the engine's step, which waits
    loop = live.frontend.loop
    assert loop is not None
    update = asyncio.run_coroutine_threadsafe(live.frontend.call_idle(lambda e: update_engine_weights(e, new), abort_running), loop)
    live.in_loop(asyncio.sleep(0))  # the update's task ran up to its pause (tasks start in order) before the step goes on
    gate.release.set()
    assert update.result(60) == version + 1
    running.join(60)
    first = answer["a"]
    assert first["weight_version"] == version
    if abort_running:
        assert first["finish_reason"] == "abort" and len(first["token_ids"]) < 40
    else:
        assert first["finish_reason"] == "length" and len(first["token_ids"]) == 40
    assert complete(http)["weight_version"] == version + 1
    live.check_idle_and_free()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_reports_its_weight_version(gated, root, path) -> None:
    live, (gate,) = gated
    gate.release.set()
    http = httpx.Client(base_url=live.base_url, timeout=120)
    save_model(new_model(live, 30), os.path.join(root, "streamed"))
    r = http.post("/update_weights_from_disk", json={"model_path": os.path.join(root, "streamed")})
    assert r.status_code == 200, r.text
    version = r.json()["weight_version"]
    assert version > 0  # not the default an unset field would read as
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    chunks = events(http, path, body)
    *choice_chunks, usage_chunk = chunks
    ends = [c for c in choice_chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["choices"][0]["index"] for c in ends) == [0, 1]
    if path == "/v1/completions":  # per choice, as in a whole response
        assert [c["choices"][0]["weight_version"] for c in ends] == [version, version]
        assert all(c["choices"][0]["weight_version"] is None for c in choice_chunks if c not in ends)
    else:  # on the response, as in a whole response
        assert [c["weight_version"] for c in ends] == [version, version] and usage_chunk["weight_version"] == version
        assert all(c["weight_version"] is None for c in choice_chunks if c not in ends)
    live.check_idle_and_free()
