"""Held-out acceptance of a trained draft (an MTP layer, an EAGLE-3 head): what `openk3 train-mtp` and `train-eagle3` report.

Greedy decoding of every held-out chapter's opening twice, without and with the draft, on one target: the engine's
spec_decode counters of the speculative run, and whether every output equals the non-speculative one (it must: drafts
only decide speed).
"""

from __future__ import annotations

from typing import Any

from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.runner import CausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.speculative import SpeculativeConfig
from openk3.serve.tokenizer import Tokenizer


def held_out_acceptance(target: CausalLM, tokenizer: Tokenizer, held: list[list[int]], prompt_tokens: int, new_tokens: int, k: int, **draft: Any) -> dict:
    """`draft`: the LLMEngine keyword that attaches the draft (`mtp_layer=...` or `eagle3_head=...`)."""
    prompts = [ids[:prompt_tokens] for ids in held]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = []
    stats = None
    for spec in (False, True):
        config = EngineConfig(max_num_seqs=8, max_model_len=prompt_tokens + new_tokens + 8, num_pages=8 * 8, page_size=16)
        engine = LLMEngine(target, tokenizer, config, speculative=SpeculativeConfig(k) if spec else None, **(draft if spec else {}))
        out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        outputs.append([out[str(i)] for i in range(len(prompts))])
        stats = engine.spec_stats
    assert stats is not None
    return {
        "k": k,
        "chapters": len(prompts),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "accepted_per_position": stats.accepted_per_position,
        "verifications": stats.num_drafts,
        "greedy_output_identical": outputs[0] == outputs[1],
    }
