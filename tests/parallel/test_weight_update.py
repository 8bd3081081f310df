"""Weight updates into a served engine (parallel/weight_update.py): official per-expert names are stacked, a dense fp32 or
bf16 update into an engine serving MXFP4 experts is quantised on the way in to exactly the bytes offline quantisation
(K3ForCausalLM.quantize_experts) gives and then answers as an engine built from those, and engines the update cannot
reach are refused by name."""

import copy
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from openk3.config import debug, save_config
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.weights import export_state_dict
from openk3.parallel.weight_update import WeightUpdateError, check_updatable, folder_tensors, served_tensors, update_engine_weights
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

BASE: dict[str, Any] = dict(page_size=4, num_pages=160, max_num_seqs=4, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(30, 61)), list(range(100, 117))]


def model(seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=seed)
    return m.eval()


def packed_buffers(m: K3ForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v for k, v in m.state_dict().items() if k.endswith(("_weight_packed", "_weight_scale"))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_update_into_mxfp4_experts_equals_offline_quantisation(dtype) -> None:
    served = model(5)
    served.quantize_experts()
    new = model(6)
    dense = {k: v.to(dtype) if v.is_floating_point() else v for k, v in new.state_dict().items()}
    offline = copy.deepcopy(new)
    with torch.no_grad():  # what the engine holds of a dense tensor sent in `dtype`
        for name, p in offline.named_parameters():
            p.copy_(dense[name])
    offline.quantize_experts()
    fresh = LLM(copy.deepcopy(offline), ByteTokenizer(256), **BASE)
    want = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY)]
    fresh.close()
    llm = LLM(served, ByteTokenizer(256), **BASE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] != want
    assert update_engine_weights(llm.engine, dense) == 1
    got, expected = packed_buffers(served), packed_buffers(offline)
    assert got.keys() == expected.keys() and len(got) == 6 * len(served.moe_layers())
    assert all(torch.equal(got[k], expected[k]) for k in got)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    llm.close()


def test_official_per_expert_names_are_stacked() -> None:
    m = model(5)
    official = export_state_dict(model(6))
    assert any(".experts.0.w1.weight" in k for k in official)
    named = served_tensors(m, official)
    want = model(6).state_dict()
    assert named.keys() <= want.keys()
    assert all(torch.equal(named[k], want[k]) for k in named)
    del official[next(k for k in official if ".experts.3.w2.weight" in k)]
    with pytest.raises(WeightUpdateError, match=r"w2 is given for experts .* but not \[3\]"):
        served_tensors(m, official)


def test_refusals_name_what_is_missing() -> None:
    with pytest.raises(WeightUpdateError, match="data-parallel"):
        check_updatable(object())  # type: ignore[arg-type]
    llm = LLM(model(5), ByteTokenizer(256), **BASE)
    with pytest.raises(WeightUpdateError, match=r"'no\.such' is not a parameter(.|\n)*lm_head.weight' has shape \(3, 3\)"):
        update_engine_weights(llm.engine, {"no.such": torch.zeros(1), "lm_head.weight": torch.zeros(3, 3)})
    assert llm.engine.weight_version == 0
    llm.close()


def test_a_folder_with_release_extras_and_transformers_a_log(tmp_path) -> None:
    new = model(6)
    tensors = export_state_dict(new)
    a_log = next(k for k in tensors if k.endswith("self_attn.A_log"))
    tensors[a_log] = tensors[a_log].reshape(1, 1, -1, 1)  # as transformers' Kimi-Linear writes it
    tensors["model.mtp.0.eh_proj.weight"] = torch.zeros(2, 2)  # the release's multi-token prediction: no part of the model
    save_config(new.config, tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    served = model(5)
    named = served_tensors(served, folder_tensors(tmp_path, served))
    want = new.state_dict()
    assert named.keys() <= want.keys() and a_log in named
    assert all(torch.equal(named[k], want[k]) for k in named)
