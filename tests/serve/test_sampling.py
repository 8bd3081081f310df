from typing import Any

import pytest
import torch

from openk3.serve.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p
from openk3.serve.sampling import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("seed", 1.5),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        kwargs: dict[str, Any] = {field: value}  # values of the wrong type too, on purpose
        SamplingParams(**kwargs)


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=-1)  # type: ignore[arg-type]  # the str/list spellings it normalises
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.top_k is None
    assert SamplingParams(top_k=0).top_k is None
    with pytest.raises(ValueError, match="SamplingParams.stop="):
        SamplingParams(stop=["ok", ""])  # type: ignore[arg-type]  # a list spelling, normalised before the check
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(n=3, seed=7).for_child(2) == SamplingParams(n=1, seed=9)


def row(params: SamplingParams, prompt=(), output=(), stops=frozenset(), generator=None) -> SamplingRow:
    return SamplingRow(params, generator, list(prompt) + list(output), len(prompt), frozenset(stops))


def test_greedy_is_argmax_and_min_tokens_masks_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    out = Sampler()(logits, [row(greedy), row(greedy)])
    assert out.token_ids == [1, 0]
    early = SamplingParams(temperature=0, min_tokens=2)
    out = Sampler()(logits, [row(early, output=[9], stops={1}), row(early, output=[9, 9], stops={0})])
    assert out.token_ids == [3, 0]  # first row may not stop yet; second has its min_tokens out


def test_penalties_follow_vllm() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert torch.allclose(apply_penalties(logits, [r]), torch.tensor([[1.0, -4.0, 1.0, 1.0, 0.5]]))
    r = row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[2], output=[3, 3, 4])
    assert torch.allclose(apply_penalties(logits, [r]), torch.tensor([[2.0, -2.0, 1.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]]))


def test_top_k_top_p_min_p_masks() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log()
    vocab = torch.tensor([4])

    def kept(top_k, top_p, min_p) -> list[int]:
        out = apply_top_k_top_p_min_p(logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return (out > torch.finfo(out.dtype).min).nonzero()[:, 1].tolist()

    assert kept(2, 1.0, 0.0) == [0, 1]
    assert kept(int(vocab), 0.65, 0.0) == [0, 1]  # 0.4 < 0.65, 0.4 + 0.3 >= 0.65
    assert kept(int(vocab), 0.69, 0.0) == [0, 1]
    assert kept(int(vocab), 0.71, 0.0) == [0, 1, 2]
    assert kept(int(vocab), 0.01, 0.0) == [0]
    assert kept(int(vocab), 1.0, 0.45) == [0, 1, 2]  # p >= 0.45 * 0.4
    assert kept(3, 0.75, 0.3) == [0, 1]


def test_sampling_respects_masks_and_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    p = SamplingParams(top_k=3)
    toks = torch.tensor(Sampler(seed=1)(logits, [row(p)] * 4000).token_ids)
    freq = torch.bincount(toks, minlength=4).float() / 4000
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [Sampler(seed=5)(logits[1:2], [row(p, generator=torch.Generator().manual_seed(123))]).token_ids[0] for _ in range(2)]
    g = torch.Generator().manual_seed(123)
    mixed = Sampler(seed=99)(logits, [row(SamplingParams()), row(p, generator=g), row(SamplingParams())]).token_ids[1]
    assert alone[0] == alone[1] == mixed
    # the next draw of the same generator continues the sequence rather than repeating it
    seq = [Sampler()(logits[1:2], [row(p, generator=g2)]).token_ids[0] for g2 in [torch.Generator().manual_seed(123)] * 20]
    assert len(set(seq)) > 1


def test_logprobs_are_raw() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), output=[2])])
    lp = logits.log_softmax(-1)[0]
    first = out.logprobs[0]
    assert first is not None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(float(lp[out.token_ids[0]]))
    assert [t for t, _ in first.top] == [2, 1]


def test_partial_top_k_path_equals_full_sort_path() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    top_k = torch.tensor([1, 5, 40, 40, 299, 7])
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    fast = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)  # every row has a top_k: partial top-k
    # one more row without top_k forces the full sort for all rows
    full = apply_top_k_top_p_min_p(
        torch.cat([logits, logits[:1]]), torch.cat([top_k, torch.tensor([300])]), torch.cat([top_p, top_p[:1]]), torch.cat([min_p, min_p[:1]])
    )[:6]
    assert torch.equal(fast, full)
    kept = (fast > torch.finfo(fast.dtype).min).sum(-1)
    assert kept[0] == 1 and kept[2] <= 40 and kept[3] <= 40


def test_draws_are_made_where_the_logits_are() -> None:
    """The engine makes a seeded request's generator on its own device, the sampler draws q there (no M x V copy); a
    generator on another kind of device is refused by name rather than copied across."""
    from openk3.serve.config import EngineConfig
    from openk3.serve.engine import LLMEngine
    from openk3.serve.loading import build_model

    model, tok = build_model("debug", torch.float32, "cpu", 0)
    engine = LLMEngine(model, tok, EngineConfig(max_model_len=64, num_pages=16))
    engine.add_request("a", [1, 2, 3], SamplingParams(seed=3, max_tokens=2))
    generator = engine.scheduler.requests["a"].generator
    assert generator is not None and generator.device == engine.device
    assert engine.runner.sampler.generator.device == engine.device
    with pytest.raises(ValueError, match="generators must be there too"):
        Sampler._on(torch.device("meta"), torch.Generator())  # a CPU generator for logits elsewhere: refused, not copied
    assert Sampler._on(torch.device("cpu"), generator) is generator
