"""Prefill/decode disaggregation through the engine seam (serve/cache/handoff.py): a prefill engine computes P[:-1] and exports
the snapshot at len(P) - 1, a decode engine imports it and serves P. Greedy tokens (and their logprobs, to 1e-4) equal an
aggregated engine's, the decode engine shows the hit (cached tokens == len(P) - 1), and every damaged or foreign record is
refused with a clear error or misses -- never wrong text."""

import asyncio
import dataclasses
import random
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.cache import tier_record
from openk3.serve.cache.tier_record import MAGIC, TierRecordError
from openk3.serve.cache.tier_types import TierEntry, TierKind
from openk3.serve.cache.transfer import buffer_nbytes
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.output import OutputKind
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

PAGE = 64
GEN = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
PREFILL = SamplingParams(temperature=0, max_tokens=1)  # the sampled token is discarded: the decode engine samples it again
ENGINE: dict[str, Any] = dict(page_size=PAGE, num_pages=24, max_num_seqs=2, max_model_len=512, long_prefill_token_threshold=96)
LENGTHS = (10, 64, 65, 100, 129, 200)  # below, at, one past the page (boundary 63, 64), and several pages


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(seed: int = 5, **changes) -> K3ForCausalLM:
    m = K3ForCausalLM(dataclasses.replace(debug(), **changes))
    m.init_weights(seed=seed)
    return m.eval()


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return build()


def engine(model, **cfg) -> LLM:
    return LLM(model, ByteTokenizer(256), **{**ENGINE, "enable_prefix_caching": True, "num_snapshot_slots": 6, **cfg})


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(n * 1000 + seed)
    return [rng.randrange(256) for _ in range(n)]


def completion(llm: LLM, p: list[int]):
    out = llm.generate([p], GEN)[0]
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None
    return out, (list(out.token_ids), [lp.logprob for lp in logprobs])


def same(got, ref) -> bool:
    return got[0] == ref[0] and torch.allclose(torch.tensor(got[1]), torch.tensor(ref[1]), atol=1e-4)


@pytest.fixture(scope="module")
def aggregated(model) -> dict[int, tuple[list[int], list[float]]]:
    llm = LLM(model, ByteTokenizer(256), **ENGINE)  # no prefix caching: every prompt computed in full
    ref = {n: completion(llm, prompt(n))[1] for n in LENGTHS}
    llm.close()
    return ref


@pytest.fixture(scope="module")
def records(model) -> dict[int, bytes]:
    llm = engine(model)
    out = {}
    for n in LENGTHS:
        p = prompt(n)
        llm.generate([p[:-1]], PREFILL)
        record = llm.engine.export_prefix(p[:-1])
        assert record is not None, n
        out[n] = record
    llm.engine.check_integrity()
    llm.close()
    return out


def serve(model, record: bytes | None, p: list[int], **cfg):
    """A fresh decode engine that imports `record` (when given) and serves p; its output, result and engine."""
    llm = engine(model, **cfg)
    if record is not None:
        assert llm.engine.import_prefix(record) == len(p) - 1
    out, res = completion(llm, p)
    llm.engine.check_integrity()
    return out, res, llm


@pytest.mark.parametrize("n", LENGTHS)
def test_disaggregated_equals_aggregated(model, aggregated, records, n) -> None:
    out, res, llm = serve(model, records[n], prompt(n))
    assert out.num_cached_tokens == n - 1  # the decode engine computed only the last prompt token
    assert same(res, aggregated[n])
    inbox = llm.engine.cache.inbox
    assert inbox is not None and len(inbox) == 0 and inbox.stats().hits == 1  # used once, then the device holds it
    again = llm.generate([prompt(n)], GEN)[0]  # from the device snapshot the hand-off became
    assert again.num_cached_tokens == n - 1 and list(again.token_ids) == aggregated[n][0]
    llm.close()


def test_one_decode_engine_takes_many_handoffs(model, aggregated, records) -> None:
    llm = engine(model)
    for n in LENGTHS:
        llm.engine.import_prefix(records[n])
    outs = llm.generate([prompt(n) for n in LENGTHS], GEN)
    assert [o.num_cached_tokens for o in outs] == [n - 1 for n in LENGTHS]
    assert all(list(o.token_ids) == aggregated[n][0] for o, n in zip(outs, LENGTHS, strict=True))
    assert llm.engine.cache.inbox is not None and len(llm.engine.cache.inbox) == 0
    llm.engine.check_integrity()
    llm.close()


def _flip(record: bytes, at: int) -> bytes:
    raw = bytearray(record)
    raw[at] ^= 0xFF
    return bytes(raw)


def _header_end(record: bytes) -> int:
    return len(MAGIC) + 8 + int.from_bytes(record[len(MAGIC) : len(MAGIC) + 8], "little")


DAMAGE = {
    "payload byte": (lambda r: _flip(r, len(r) - 5), "checksum"),
    "first state byte": (lambda r: _flip(r, _header_end(r)), "checksum"),
    "magic": (lambda r: _flip(r, 0), "bad magic"),
    "header length": (lambda r: _flip(r, len(MAGIC) + 7), "header length"),
    "header text": (lambda r: _flip(r, len(MAGIC) + 8), "not JSON"),
    "truncated": (lambda r: r[:-100], "truncated"),
    "empty": (lambda r: b"", "bad magic"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_record_is_refused_and_the_request_recomputes(model, aggregated, records, damage) -> None:
    n = 100
    spoil, why = DAMAGE[damage]
    llm = engine(model)
    with pytest.raises(TierRecordError, match=why):
        llm.engine.import_prefix(spoil(records[n]))
    out, res = completion(llm, prompt(n))
    assert out.num_cached_tokens == 0 and same(res, aggregated[n])
    llm.engine.check_integrity()
    llm.close()


def _reencode(record: bytes, **changes) -> bytes:
    """A well-formed record (valid checksum) with a changed entry: what a buggy or foreign exporter could send."""
    return tier_record.encode(dataclasses.replace(tier_record.decode(record), **changes))


def test_pages_without_state_are_refused(model, aggregated, records) -> None:
    n = 129
    e = tier_record.decode(records[n])
    llm = engine(model)
    cache = llm.engine.cache.tensors
    state = sum(p[0].numel() * p.element_size() for p in (*cache.kda_state, *cache.conv_state))
    latents_only = _reencode(records[n], buffer=e.buffer[state:].clone())
    short_state = _reencode(records[n], buffer=torch.cat([e.buffer[: state // 2], e.buffer[state:]]))
    for bad in (latents_only, short_state):
        with pytest.raises(TierRecordError, match="different model shape or cache dtype"):
            llm.engine.import_prefix(bad)
    with pytest.raises(TierRecordError, match="snapshot key"):  # tail tokens changed, checksum redone
        llm.engine.import_prefix(_reencode(records[n], tail=(1, 2)))
    # a boundary one page shorter than its anchor, sized to pass the import checks: the lookup drops it
    forged = _reencode(records[n], num_tokens=n - 1 - PAGE, buffer=torch.zeros(buffer_nbytes(cache, n - 1 - PAGE), dtype=torch.uint8))
    assert llm.engine.import_prefix(forged) == n - 1 - PAGE
    out, res = completion(llm, prompt(n))
    assert out.num_cached_tokens == 0 and same(res, aggregated[n])
    assert llm.engine.cache.inbox is not None and len(llm.engine.cache.inbox) == 0
    llm.engine.check_integrity()
    llm.close()


def test_record_of_another_model_shape_is_refused(model, aggregated) -> None:
    n = 100
    other = build(mla=dataclasses.replace(debug().mla, kv_lora_rank=16))
    pre = engine(other)
    p = prompt(n)
    pre.generate([p[:-1]], PREFILL)
    record = pre.engine.export_prefix(p[:-1])
    pre.close()
    assert record is not None
    llm = engine(model)
    with pytest.raises(TierRecordError, match=r"this engine's cache needs \d+ .*different model shape"):
        llm.engine.import_prefix(record)
    out, res = completion(llm, p)
    assert out.num_cached_tokens == 0 and same(res, aggregated[n])
    llm.close()


def test_record_of_other_weights_never_matches(model, aggregated) -> None:
    n = 100
    pre = engine(build(seed=6))  # same shape, other weights: another salt
    p = prompt(n)
    pre.generate([p[:-1]], PREFILL)
    record = pre.engine.export_prefix(p[:-1])
    pre.close()
    assert record is not None
    out, res, llm = serve(model, record, p)
    assert out.num_cached_tokens == 0 and same(res, aggregated[n])
    assert llm.engine.cache.inbox is not None and len(llm.engine.cache.inbox) == 1  # it ages out by LRU
    llm.close()


def test_record_of_another_page_size_is_refused(model, records) -> None:
    llm = engine(model, page_size=32, num_pages=48)
    with pytest.raises(TierRecordError, match="different page size"):
        llm.engine.import_prefix(records[100])
    llm.close()


def test_export_finds_tiers_and_misses_cleanly(model, records) -> None:
    llm = engine(model, num_snapshot_slots=1, cpu_offload_bytes=2**24)
    p, q = prompt(100), prompt(65)
    llm.generate([p[:-1]], PREFILL)
    llm.generate([q[:-1]], PREFILL)  # one snapshot slot: p's snapshot moves to the host tier
    stats = llm.engine.stats().prefix_cache
    assert stats is not None and (host := stats.tier(TierKind.HOST)) is not None and host.entries >= 1
    assert llm.engine.export_prefix(p[:-1]) == records[100]  # from the host tier, byte for byte
    assert llm.engine.export_prefix(q[:-1]) == records[65]  # from the device
    assert llm.engine.export_prefix(p[:-2]) is None and llm.engine.export_prefix([]) is None
    llm.close()


def test_handoff_needs_prefix_caching(model, records) -> None:
    llm = LLM(model, ByteTokenizer(256), **ENGINE)
    with pytest.raises(RuntimeError, match="enable_prefix_caching"):
        llm.engine.export_prefix([1, 2, 3])
    with pytest.raises(RuntimeError, match="enable_prefix_caching"):
        llm.engine.import_prefix(records[10])
    llm.close()


def test_unused_handoffs_age_out_within_the_budget(model, records) -> None:
    llm = engine(model)
    inbox = llm.engine.cache.inbox
    assert inbox is not None
    sizes = {n: tier_record.decode(records[n]).nbytes for n in LENGTHS}
    inbox.capacity_bytes = sizes[200] + sizes[129]  # room for the two largest
    for n in LENGTHS:
        llm.engine.import_prefix(records[n])
        inbox.check_integrity()
    assert inbox.used_bytes <= inbox.capacity_bytes
    assert sorted(e.num_tokens for e in inbox.entries.values()) == [128, 199]  # the least recently imported went first
    assert inbox.dropped == len(LENGTHS) - 2
    too_big = TierEntry(b"k" * 16, b"a" * 16, (), 0, torch.zeros(inbox.capacity_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not fit the transfer inbox"):
        inbox.put(too_big)
    llm.engine.check_integrity()
    llm.close()


def test_handoff_between_async_frontends(model, aggregated) -> None:
    """What the cross-process wiring does, in one process: prefill on one frontend, export and import on the engine threads
    (`AsyncEngine.call`), decode on the other frontend."""
    n = 129
    p = prompt(n)

    async def body() -> tuple[list[int], int, int]:
        pre, dec = (AsyncEngine(LLMEngine(model, ByteTokenizer(256), EngineConfig(**ENGINE, enable_prefix_caching=True))) for _ in range(2))
        pre.start()
        dec.start()
        try:
            async for _ in pre.generate("prefill", p[:-1], PREFILL, OutputKind.FINAL_ONLY):
                pass
            record = await pre.call(lambda e: e.export_prefix(p[:-1]))
            assert record is not None
            boundary = await dec.call(lambda e: e.import_prefix(record))
            tokens, cached = [], -1
            async for out in dec.generate("decode", p, GEN, OutputKind.FINAL_ONLY):
                tokens, cached = list(out.outputs[0].token_ids), out.num_cached_tokens
            await dec.call(lambda e: e.check_integrity())
            return tokens, cached, boundary
        finally:
            await pre.shutdown(timeout=5)
            await dec.shutdown(timeout=5)

    tokens, cached, boundary = asyncio.run(body())
    assert boundary == cached == n - 1 and tokens == aggregated[n][0]
