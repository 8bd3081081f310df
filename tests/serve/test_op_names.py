"""EngineConfig.ops (serve/op_names.py): op implementations named for an engine. The pairs are parsed into OpChoice fields
(each bad form refused with the field and the value), checked against the registry for the device that runs them (a
CUDA kernel on CPU fails at start-up, naming what can run), and the engine's model really runs them -- the checkpoint's
packed_experts kept -- with the greedy tokens of the default ops."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import pytest
import torch

from openk3.config import debug
from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.llm import LLM
from openk3.model import K3ForCausalLM, OpChoice
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import LocalExperts
from openk3.ops.registry import OpTarget, op, registry
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.op_names import FIELDS, NOT_NAMED, REGISTRY_OPS, check_op_names, parse_op_names, select_named_ops
from openk3.serve.prepare import FusedProjections, prepare_for_serving
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.model.conftest import build

CUDA = OpTarget("cuda")
GPU_KERNELS = "kda=fla,mla=triton,mla_decode=triton,moe=triton"
NAIVE = "kda=naive,conv=naive,mla=naive,moe=naive"
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 1, 1, 7], list(range(30, 70))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_pairs_become_opchoice_fields_in_one_canonical_form() -> None:
    assert parse_op_names(" moe=triton, kda=fla ,kda_chunk_size=32") == {"moe": "triton", "kda": "fla", "kda_chunk_size": 32}
    assert parse_op_names({"kda": "fla", "kda_chunk_size": 32}) == {"kda": "fla", "kda_chunk_size": 32}
    assert parse_op_names(None) == parse_op_names("") == parse_op_names(" ") == {}
    # held in OpChoice's field order, so the string, the dict and another order are the same setting
    from_dict = EngineConfig(ops={"kda": "fla", "moe": "triton"})  # type: ignore[arg-type]  # LLM(ops={...}) passes a dict
    same = [EngineConfig(ops="moe=triton,kda=fla"), from_dict, EngineConfig(ops="kda=fla,moe=triton")]
    assert {c.ops for c in same} == {"kda=fla,moe=triton"} and same[0] == same[1]
    assert same[0].op_names == {"kda": "fla", "moe": "triton"}
    assert EngineConfig(ops="").ops is None and EngineConfig().op_names == {}


def test_every_opchoice_field_but_packed_experts_can_be_named() -> None:
    assert set(FIELDS) | set(NOT_NAMED) == {f.name for f in dataclasses.fields(OpChoice)}
    for registry_op in REGISTRY_OPS.values():
        assert "auto" in registry().names(registry_op)


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ("kda", "'kda' is not a field=implementation pair (e.g. kda=fla,mla=triton)"),
        ("kda=", "'kda=' is not a field=implementation pair"),
        ("=fla", "'=fla' is not a field=implementation pair"),
        ("kda=fla=x", "'kda=fla=x' is not a field=implementation pair"),
        ("kda=fla,", "'' in 'kda=fla,' is not a field=implementation pair"),
        (
            "attention=fla",
            "unknown field 'attention': expected one of kda, conv, mla, mla_decode, moe, attn_res, linear, norm, route, glu, vision_attn, kda_chunk_size",
        ),
        ("kda=fla,mla=triton,kda=naive", "kda is named twice ('fla' and 'naive')"),
        ("packed_experts=true", "packed_experts cannot be named: it follows the checkpoint"),
        ("kda_chunk_size=48", "OpChoice.kda_chunk_size=48 is invalid: expected None or a power of two"),
        ("kda_chunk_size=big", "kda_chunk_size='big' is invalid: expected an integer"),
        ({"kda": 3}, "kda=3 is invalid: expected an implementation name"),
        ({"kda_chunk_size": True}, "kda_chunk_size=True is invalid: expected an integer"),
        (["kda=fla"], "['kda=fla'] is invalid: expected field=implementation pairs"),
    ],
)
def test_bad_pairs_are_refused_naming_the_field_and_value(ops: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(ops=ops)  # type: ignore[arg-type]  # the check under test
    assert str(e.value).startswith("EngineConfig.ops: ") and message in str(e.value)


def test_names_are_checked_for_the_device_that_runs_them() -> None:
    check_op_names(parse_op_names(GPU_KERNELS), CUDA)
    check_op_names({"kda": "fla_recurrent", "mla": "auto", "kda_chunk_size": 16}, CUDA)
    with pytest.raises(ValueError, match=r"kda='fla' cannot run on cpu float32: expected one of autograd, fast, mixed, naive, auto \(on cpu float32"):
        check_op_names({"kda": "fla"}, OpTarget())
    with pytest.raises(ValueError, match="moe='triton' cannot run on cpu bfloat16: expected one of .*naive"):
        check_op_names({"moe": "triton"}, OpTarget(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"mla='flash' is not an implementation of mla_prefill: expected one of .*triton, auto \(on cuda float32"):
        check_op_names({"mla": "flash"}, CUDA)
    # what the entry points that build the model check before the weights load, on the configured device
    with pytest.raises(ValueError, match="kda='fla' cannot run on cpu float32"):
        EngineConfig(ops="kda=fla").check_ops_on_device()
    EngineConfig(ops="mla=triton,mla_decode=triton,moe=triton", device="cuda").check_ops_on_device()  # triton is a test dependency


def test_gpu_kernels_are_selected_for_cuda_keeping_the_checkpoints_packed_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import types

    real = importlib.import_module  # fla is not installed here: a stand-in module passes the start-up import check
    monkeypatch.setattr(importlib, "import_module", lambda name, package=None: types.ModuleType(name) if name.startswith("fla") else real(name, package))
    model = K3ForCausalLM(debug(), OpChoice(packed_experts=True)).eval()
    prepare_for_serving(model, torch.device("cuda"), ops=parse_op_names(GPU_KERNELS))  # selection only: nothing is launched
    assert model.ops == OpChoice(kda="fla", mla="triton", mla_decode="triton", moe="triton", packed_experts=True)
    layers = [layer.self_attn for layer in model.model.layers]
    kda = [a for a in layers if isinstance(a, KimiDeltaAttention)]
    mla = [a for a in layers if isinstance(a, GatedMLA)]
    assert kda and all(a.kda_prefill is op("kda_prefill", "fla", CUDA) and a.kda_decode is op("kda_decode", "fla", CUDA) for a in kda)
    assert mla and all(a.prefill is op("mla_prefill", "triton", CUDA) and a.decode is op("mla_decode", "triton", CUDA) for a in mla)
    assert all(isinstance(m.backend, LocalExperts) and m.backend.impl == "triton" for m in model.moe_layers())


def test_a_model_the_names_cannot_apply_to_is_refused_unchanged() -> None:
    model = build(debug())
    with pytest.raises(ValueError, match="names implementations of K3ForCausalLM's ops, but the engine's model is a Linear"):
        select_named_ops(torch.nn.Linear(2, 2), {"kda": "naive"}, OpTarget())
    model.train()
    with pytest.raises(ValueError, match="'kda=naive': the model is in training mode"):
        prepare_for_serving(model, torch.device("cpu"), ops={"kda": "naive"})
    model.eval()
    model.moe_layers()[1].backend = LocalExperts("batched")  # a name set on the backend itself, which select_ops keeps
    with pytest.raises(ValueError, match="moe='naive': the experts of layer .* were given their own implementation 'batched'"):
        prepare_for_serving(model, torch.device("cpu"), ops={"kda": "naive", "moe": "naive"})
    assert model.ops == OpChoice()  # refused before anything was selected
    model.moe_layers()[1].backend = lambda layer, z, routing: z  # another expert backend: it takes no name
    with pytest.raises(ValueError, match="moe='naive': the experts of layer .* run through function, which takes no implementation name"):
        prepare_for_serving(model, torch.device("cpu"), ops={"moe": "naive"})
    dense = K3ForCausalLM(debug()).eval()  # a preset's dense experts: the MXFP4 kernel has nothing to read
    with pytest.raises(ValueError, match="moe='triton' reads packed MXFP4 experts, and this model's experts are dense"):
        prepare_for_serving(dense, torch.device("cuda"), ops={"moe": "triton"})
    assert dense.ops == OpChoice()


class Driver:
    """A model the engine cannot prepare (as a multi-rank driver): it only obeys the serve <-> model contract."""

    config = debug()

    def __call__(self, batch: object, cache: object) -> torch.Tensor:
        raise AssertionError("never run")

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return iter([])


def test_the_engine_runs_its_model_as_given_and_build_engine_prepares_it() -> None:
    """The engine never selects ops nor ties projections (a multi-rank driver's ranks did, or build_engine): the names
    reach the model through build_engine's serving layout only."""
    LLMEngine(Driver(), ByteTokenizer(256), EngineConfig(ops="kda=naive", max_num_seqs=2, num_pages=8)).close()
    model = K3ForCausalLM(debug()).eval()
    LLMEngine(model, ByteTokenizer(256), EngineConfig(ops="kda=naive", max_num_seqs=2, num_pages=8)).close()
    assert model.ops == OpChoice() and not any(isinstance(m, FusedProjections) for m in model.modules())
    built = build_engine(EngineSpec(model, EngineConfig(ops="kda=naive", max_num_seqs=2, num_pages=8)))
    built.core.close()
    assert any(isinstance(m, FusedProjections) for m in model.modules())
    assert model.ops == OpChoice(kda="naive")


def greedy(llm: LLM) -> list[list[int]]:
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


def test_llm_runs_the_named_implementations_with_the_default_tokens() -> None:
    want = greedy(LLM("tiny", max_num_seqs=4, max_model_len=128))
    llm = LLM("tiny", ops=NAIVE, max_num_seqs=4, max_model_len=128)
    model = llm.model
    assert isinstance(model, K3ForCausalLM)
    assert model.ops == OpChoice(kda="naive", conv="naive", mla="naive", moe="naive", packed_experts=True)  # the checkpoint's packing kept
    layers = [layer.self_attn for layer in model.model.layers]
    kda = [a for a in layers if isinstance(a, KimiDeltaAttention)]
    assert kda and all(a.kda_prefill is op("kda_prefill", "naive") and a.kda_decode is op("kda_decode", "naive") for a in kda)
    assert all(a.conv_prefill is op("short_conv", "naive") for a in kda)
    # mla_decode "auto" follows the naive prefill to the definition
    assert all(a.prefill is op("mla_prefill", "naive") and a.decode is op("mla_decode", "naive") for a in layers if isinstance(a, GatedMLA))
    assert all(isinstance(m.backend, LocalExperts) and m.backend.op is op("moe_experts", "naive") for m in model.moe_layers())
    assert greedy(llm) == want


def test_a_gpu_kernel_on_cpu_is_a_startup_error() -> None:
    with pytest.raises(ValueError, match="EngineConfig.ops: kda='fla' cannot run on cpu float32: expected one of autograd, fast, mixed, naive, auto"):
        LLM("debug", ops="kda=fla")  # refused before the model is built
    module = build(debug())
    with pytest.raises(ValueError, match="EngineConfig.ops: mla='triton' cannot run on cpu float32"):
        LLM(module, ops="mla=triton")  # checked on the module's own device, as the engine prepares it
    with pytest.raises(ValueError, match="unknown field 'attention'"):
        LLM("debug", ops="attention=triton")


def test_a_gpu_kernel_whose_package_is_missing_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton and fla (the gpu extra) are imported by their entries on first call: a serving engine checks them before it
    builds the model, so a missing package is refused at start-up, not at the first request."""
    import importlib

    real = importlib.import_module

    def without(name: str, package: str | None = None) -> object:
        if name.split(".")[0] in ("fla", "triton"):
            raise ImportError(f"No module named {name.split('.')[0]!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without)
    with pytest.raises(ValueError, match=r"kda='fla' needs fla, which cannot be imported \(No module named 'fla'\): pip install 'openk3\[gpu\]'"):
        EngineConfig(ops="kda=fla", device="cuda", dtype="bfloat16").check_ops_on_device()
    with pytest.raises(ValueError, match=r"moe='triton' needs triton, which cannot be imported"):
        EngineConfig(ops="mla=naive,moe=triton", device="cuda", dtype="bfloat16").check_ops_on_device()
    EngineConfig(ops="kda=naive,mla=auto", device="cuda", dtype="bfloat16").check_ops_on_device()  # nothing optional named
    assert registry().entry("mla_decode", "triton", CUDA)[1].requires == ("triton",)
    assert registry().entry("kda_prefill", "fla_recurrent", CUDA)[1].requires == ("fla.ops.kda",)


def test_a_module_given_to_llm_takes_the_names_as_its_own() -> None:
    module = build(debug())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no preset warning: the module is used as given
        llm = LLM(module, ops={"moe": "naive", "kda_chunk_size": 16}, max_num_seqs=2, max_model_len=64)
    try:
        assert llm.model is module and module.ops == OpChoice(moe="naive", kda_chunk_size=16)
        assert all(isinstance(m.backend, LocalExperts) and m.backend.impl == "naive" for m in module.moe_layers())
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    finally:
        llm.close()
