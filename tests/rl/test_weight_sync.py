"""Weight sync: after update_weights(llm, new_state_dict) the engine answers exactly as a fresh engine built from the new
weights (greedy, fp32), its prefix cache no longer hits the prompt cached under the old weights, the packed CPU copies follow
the new values, and a wrong name or shape is refused before anything is written."""

import copy
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.rl.weight_sync import update_weights
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

BASE: dict[str, Any] = dict(page_size=4, num_pages=160, max_num_seqs=4, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def model(seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=seed)
    return m.eval()


@pytest.mark.parametrize("pack_cpu_weights", [False, True])
def test_update_equals_a_fresh_engine_of_the_new_weights(pack_cpu_weights) -> None:
    old, new = model(5), model(6)
    prompts = [list(range(30, 61)), list(range(100, 117))]
    fresh = LLM(copy.deepcopy(new), ByteTokenizer(256), pack_cpu_weights=pack_cpu_weights, **BASE)
    want = [o.token_ids for o in fresh.generate(prompts, GREEDY)]
    fresh.close()
    llm = LLM(old, ByteTokenizer(256), enable_prefix_caching=True, prefix_match_unit=8, pack_cpu_weights=pack_cpu_weights, **BASE)
    before = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert before != want  # the two weight sets answer differently, or the test shows nothing
    # a repeated prompt hits from its second repeat on (the first leaves a state one token before its end)
    cached = [llm.generate(prompts[:1], GREEDY)[0] for _ in range(2)][-1]
    assert cached.num_cached_tokens > 0  # the prompt is cached under the old weights
    assert update_weights(llm, new.state_dict()) == 1
    after = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in after] == want
    assert after[0].num_cached_tokens == 0  # rekeyed: no state of the old weights is hit
    again = [llm.generate(prompts[:1], GREEDY)[0] for _ in range(2)][-1]
    assert again.num_cached_tokens > 0 and again.token_ids == want[0]  # states of the new weights are cached as usual
    llm.engine.check_integrity()
    llm.close()


def test_partial_update_and_refusals() -> None:
    old, new = model(5), model(6)
    llm = LLM(old, ByteTokenizer(256), **BASE)
    name = "lm_head.weight"
    with pytest.raises(ValueError, match="not a parameter"):
        update_weights(llm, {"no.such.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        update_weights(llm, {name: torch.zeros(3, 3)})
    assert llm.engine.weight_version == 0
    llm.processor.add_request("running", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="requests are running"):
        update_weights(llm, {name: new.state_dict()[name]})
    llm.processor.abort("running")
    assert update_weights(llm, {name: new.state_dict()[name]}) == 1
    assert torch.equal(dict(llm.model.named_parameters())[name], new.state_dict()[name])  # type: ignore[attr-defined]
    llm.close()
