"""Prefix caching on the real K3 model (debug preset, fp32): greedy tokens with caching -- device only, and with the host and
disk tiers forced -- equal the tokens without caching, token for token. The sampled tokens' logprobs are compared too (to 1e-4):
greedy tokens of a small random model can survive a wrong latent, its logprobs cannot."""

import os
import random

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
BASE = dict(page_size=4, num_pages=160, max_num_seqs=4, max_model_len=256, long_prefill_token_threshold=16)
CACHED = dict(enable_prefix_caching=True, prefix_match_unit=8)
TIERS = {
    "device": dict(num_snapshot_slots=6),
    "device_tight": dict(num_snapshot_slots=2, num_pages=48, max_model_len=160),
    "host": dict(num_snapshot_slots=1, cpu_offload_bytes=64 * 2**20),
    "disk": dict(num_snapshot_slots=1, disk_offload_bytes=64 * 2**20),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=5)
    return m.eval()


def make(model, tmp_path, **cfg) -> LLM:
    args = {**BASE, **cfg}
    if args.get("disk_offload_bytes"):
        args["disk_offload_dir"] = str(tmp_path)
    return LLM(model, ByteTokenizer(256), **args)


def flush(llm: LLM) -> None:
    prefix = llm.engine.cache.prefix
    if prefix is not None and prefix.tiers is not None:
        prefix.tiers.flush()


Result = tuple[list[int], list[float]]  # a completion's token ids and their logprobs


def result(out) -> Result:
    return list(out.token_ids), [lp.logprob for lp in out.outputs[0].logprobs]


def same(got, ref) -> bool:
    """Tokens equal exactly; logprobs within 1e-4 (cached runs chunk the prompt differently, so fp32 sums differ in rounding)."""
    return [g[0] for g in got] == [r[0] for r in ref] and all(
        torch.allclose(torch.tensor(g[1]), torch.tensor(r[1]), atol=1e-4) for g, r in zip(got, ref, strict=True)
    )


def conversations(llm: LLM, seed: int, num_convs: int = 3, turns: int = 3) -> list[Result]:
    """Random multi-turn chats run side by side: each turn's prompt is the previous prompt + its reply + a new message."""
    rng = random.Random(seed)
    histories = [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(num_convs)]
    replies = []
    for _ in range(turns):
        outs = llm.generate([list(h) for h in histories], GREEDY)
        llm.engine.check_integrity()
        flush(llm)
        for h, out in zip(histories, outs, strict=True):
            replies.append(result(out))
            h.extend(out.token_ids)
            h.extend(rng.randrange(256) for _ in range(rng.randrange(2, 20)))
    return replies


def shared_prefix_batches(llm: LLM, seed: int) -> list[Result]:
    """Two rounds of a batch whose prompts share three long prefixes with different suffixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(20, 40))] for _ in range(3)]
    out = []
    for _ in range(2):
        prompts = [p + [rng.randrange(256) for _ in range(rng.randrange(1, 10))] for p in prefixes for _ in range(2)]
        out += [result(o) for o in llm.generate(prompts, GREEDY)]
        llm.engine.check_integrity()
        flush(llm)
    return out


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[str, list[Result]]:
    llm = make(model, tmp_path_factory.mktemp("ref"))
    return {"conv": conversations(llm, 1), "shared": shared_prefix_batches(llm, 2)}


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_cached_tokens_equal_uncached(model, reference, tmp_path, tier) -> None:
    llm = make(model, tmp_path, **CACHED, **TIERS[tier])
    try:
        assert same(conversations(llm, 1), reference["conv"])
        assert same(shared_prefix_batches(llm, 2), reference["shared"])
        stats = llm.engine.stats().prefix_cache
        assert stats is not None and stats.hits > 0 and stats.hit_tokens > 0
        if tier in ("host", "disk"):
            lower = stats.tier(TierKind(tier))
            assert lower is not None and lower.hits > 0 and lower.bytes_out > 0, stats
    finally:
        llm.close()


def test_corrupted_disk_file_recomputes_the_same_tokens(model, reference, tmp_path) -> None:
    llm = make(model, tmp_path, **CACHED, **TIERS["disk"])
    try:
        assert same(conversations(llm, 1), reference["conv"])
        prefix = llm.engine.cache.prefix
        assert prefix is not None and prefix.tiers is not None and prefix.tiers.disk is not None
        disk = prefix.tiers.disk
        files = sorted(os.listdir(disk.dir))
        assert files
        for name in files:  # flip one payload byte near the end of every file
            path = os.path.join(disk.dir, name)
            raw = bytearray(open(path, "rb").read())
            raw[-3] ^= 0xFF
            open(path, "wb").write(bytes(raw))
        assert same(shared_prefix_batches(llm, 2), reference["shared"])
        rng = random.Random(1)
        histories = [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
        replay = llm.generate(histories, GREEDY)  # the first turn again: its states now live only in corrupted files
        assert same([result(o) for o in replay], reference["conv"][:3])
        assert disk.stats().checksum_failures > 0
        llm.engine.check_integrity()
    finally:
        llm.close()
    assert not os.path.exists(disk.dir)


def test_branch_point_is_snapshotted_for_the_next_request(model, tmp_path) -> None:
    llm = make(model, tmp_path, enable_prefix_caching=True, prefix_match_unit=64, num_snapshot_slots=8)
    shared = list(range(1, 21))  # 20 tokens: no match-unit cut inside, so only a branch point can hold a state at 20
    prompts = [shared + [200 + i] * 3 for i in range(3)]
    cached = [llm.generate([p], GREEDY)[0].num_cached_tokens for p in prompts]
    # 1st: nothing cached; 2nd: diverges inside the 1st's run at 20, a miss that snapshots at 20; 3rd: hits there
    assert cached == [0, 0, 20]
    stats = llm.engine.stats().prefix_cache
    assert stats is not None and stats.hits == 1
    llm.close()


def test_tier_options_need_prefix_caching(model) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model, ByteTokenizer(256), cpu_offload_bytes=10)


def test_multi_turn_reuses_every_previous_turn(model, tmp_path) -> None:
    llm = make(model, tmp_path, **CACHED, num_snapshot_slots=6)
    history = list(range(30, 60))
    cached = []
    for turn in range(4):
        out = llm.generate([list(history)], GREEDY)[0]
        cached.append((out.num_cached_tokens, len(history)))
        history += list(out.token_ids) + [turn + 1] * 7
    # from turn 2 on, everything but the new message (and the reply's last token, never fed to the model) is reused
    assert cached[0][0] == 0
    assert GREEDY.max_tokens is not None
    for (hit, _), (_, prev_len) in zip(cached[1:], cached[:-1], strict=True):
        assert hit == prev_len + GREEDY.max_tokens - 1
    llm.close()


def test_prefix_stats_reach_engine_stats(model, tmp_path) -> None:
    llm = make(model, tmp_path, **CACHED, cpu_offload_bytes=2**20, num_snapshot_slots=1)
    llm.generate([[1] * 20, [1] * 20 + [2] * 3, [3] * 9], GREEDY)
    s = llm.engine.stats().prefix_cache
    assert s is not None and s.queries == 3 and s.snapshots_taken >= 3 and s.snapshots_evicted >= 2
    assert [t.tier for t in s.tiers] == [TierKind.DEVICE, TierKind.HOST]
    host, device = s.tier(TierKind.HOST), s.tier(TierKind.DEVICE)
    assert host is not None and device is not None and host.bytes_in > 0 and device.used_bytes > 0
    assert torch.tensor(s.hit_rate).item() >= 0
    llm.close()


@pytest.mark.parametrize(("length", "second"), [(78, 64), (228, 192)])
@pytest.mark.parametrize("prompt_snapshots", [0, 4])
def test_a_repeated_prompt_hits_on_its_second_send(model, tmp_path, length, second, prompt_snapshots) -> None:
    """One prefill step per prompt (no chunk cut): only the states taken inside the step let the second send hit, at the
    last multiple of the match unit below the prompt's end. Either way the second send cuts at its branch point, len - 1,
    so the third hits there; the tokens equal the uncached ones every time."""
    one_step = dict(long_prefill_token_threshold=None, max_model_len=320, prefix_match_unit=64)
    prompt = [(7 * i + 3) % 251 for i in range(length)]
    ref = result(make(model, tmp_path, **one_step).generate([prompt], GREEDY)[0])
    llm = make(model, tmp_path, **one_step, enable_prefix_caching=True, prefix_prompt_snapshots=prompt_snapshots)
    outs = [llm.generate([prompt], GREEDY)[0] for _ in range(3)]
    llm.engine.check_integrity()
    assert [o.num_cached_tokens for o in outs] == [0, second if prompt_snapshots else 0, length - 1]
    assert same([result(o) for o in outs], [ref] * 3)
    llm.close()
