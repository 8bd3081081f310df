"""MLA prefill in the latent space through torch's CPU flash kernel (ops/mla/latent_flash.py) and the "sized" form
(ops/mla/blockwise.py) against the expanded reference in fp32, the registry's "auto" rule for "mla_prefill", and the engine:
chunked prefill over many chunks and prefix-cache hits give the reference layer's tokens and logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.mla import GatedMLA
from openk3.ops import thresholds
from openk3.ops.mla import latent_flash, mla_expanded
from openk3.ops.mla.blockwise import mla_expanded_or_blockwise
from openk3.ops.mla.latent_flash import latent_rows, mla_latent_flash
from openk3.ops.registry import OpTarget, registry
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.ops.test_mla import DN, DR, LR, make

SIZES = [(1, 1), (1, 2), (5, 5), (4, 9), (1, 17), (7, 70), (33, 33), (31, 257), (64, 301)]


@pytest.mark.parametrize("keys_per_call", [1 << 16, 7])
@pytest.mark.parametrize("t,s", SIZES)
def test_latent_flash_equals_expanded(monkeypatch: pytest.MonkeyPatch, keys_per_call: int, t: int, s: int) -> None:
    """Also with the cached prefix split into many flash calls (7 keys each) merged by their log-sum-exps."""
    monkeypatch.setattr(latent_flash, "PREFIX_KEYS_PER_CALL", keys_per_call)
    q_nope, q_pe, c, k_pe, w_uk, w_uv = make(t, s, seed=t + s)
    scale = (DN + DR) ** -0.5
    want = mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, s - t)
    got = mla_latent_flash(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, s - t)
    tol = 1e-5 if keys_per_call > s else 5e-5  # up to 43 partial softmaxes merged in fp32
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_latent_rows_reuse_one_buffer_and_copy_otherwise() -> None:
    lat = torch.randn(9, LR + DR)
    c, k_pe = lat.split([LR, DR], dim=-1)
    rows = latent_rows(c, k_pe)
    assert rows.data_ptr() == lat.data_ptr() and torch.equal(rows, lat)
    apart = latent_rows(c.clone(), k_pe.clone())
    assert apart.data_ptr() != lat.data_ptr() and torch.equal(apart, lat)
    assert torch.equal(latent_rows(lat[1:, :LR], lat[:-1, LR:]), torch.cat((lat[1:, :LR], lat[:-1, LR:]), dim=-1))  # not one row


def test_latent_flash_reads_a_bf16_cache_and_refuses_bad_offsets_and_autograd() -> None:
    q_nope, q_pe, c, k_pe, w_uk, w_uv = make(3, 9)
    with pytest.raises(ValueError, match="9 keys for 3 queries at offset 5"):
        mla_latent_flash(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, 5)
    got = mla_latent_flash(q_nope, q_pe, c.bfloat16(), k_pe.bfloat16(), w_uk, w_uv, 0.2, 6)  # a bf16 cache, fp32 math
    torch.testing.assert_close(got, mla_expanded(q_nope, q_pe, c.bfloat16(), k_pe.bfloat16(), w_uk, w_uv, 0.2, 6), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="CPU inference in one of"):
        mla_latent_flash(q_nope.requires_grad_(), q_pe, c, k_pe, w_uk, w_uv, 0.2, 6)
    with pytest.raises(RuntimeError, match="torch.float64 on cpu"):
        mla_latent_flash(q_nope.double(), q_pe.double(), c, k_pe, w_uk.double(), w_uv.double(), 0.2, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,s", [(1, 1), (5, 5), (7, 70), (64, 301)])
def test_half_precision_is_the_fp32_reference_to_its_rounding(dtype: torch.dtype, t: int, s: int) -> None:
    """The "cpu_half" entry: a bf16/fp16 model's chunk against the fp32 definition of the same (rounded) inputs, within the
    half type's rounding of a few products (the kernel accumulates in fp32; the two key ranges merge in fp32)."""
    q_nope, q_pe, c, k_pe, w_uk, w_uv = (x.to(dtype) for x in make(t, s, seed=t * s))
    scale = (DN + DR) ** -0.5
    want = mla_expanded(q_nope.float(), q_pe.float(), c.float(), k_pe.float(), w_uk.float(), w_uv.float(), scale, s - t)
    got = mla_latent_flash(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, s - t)
    assert got.dtype == dtype
    tol = 2 ** -(7 if dtype == torch.bfloat16 else 10) * 4
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("bound", [0, 2**40])
@pytest.mark.parametrize("t,s", [(1, 1), (4, 9), (31, 257)])
def test_sized_equals_expanded_on_both_sides_of_its_bound(monkeypatch, bound: int, t: int, s: int) -> None:
    monkeypatch.setattr(thresholds, "MLA_EXPANDED_MAX_BYTES", bound)
    q_nope, q_pe, c, k_pe, w_uk, w_uv = make(t, s, seed=3)
    want = mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, s - t)
    torch.testing.assert_close(mla_expanded_or_blockwise(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, s - t), want, atol=1e-5, rtol=1e-5)


def test_auto_rule() -> None:
    r = registry()
    assert r.entry("mla_prefill", "auto")[0] == "latent"
    assert r.entry("mla_prefill", "auto", OpTarget(c_kernels=False))[0] == "latent"
    assert r.entry("mla_prefill", "auto", OpTarget(dtype=torch.bfloat16))[0] == "latent"
    assert r.entry("mla_prefill", "auto", OpTarget(dtype=torch.float16))[0] == "latent"
    assert r.entry("mla_prefill", "auto", OpTarget(dtype=torch.float64))[0] == "sized"
    assert r.entry("mla_prefill", "latent", OpTarget(dtype=torch.bfloat16))[1].backend == "cpu_half"
    assert r.entry("mla_prefill", "auto", OpTarget("cuda"))[0] == "sized"
    assert r.entry("mla_prefill", "auto", OpTarget(training=True))[0] == "fast"


GREEDY = SamplingParams(temperature=0, max_tokens=4, logprobs=0)


def run(model: K3ForCausalLM, mla: str) -> list[tuple[list[int], list[float]]]:
    """Prompts of 150-250 tokens in 16-token chunks (10-16 chunks each), then the same prefixes again with new suffixes
    (prefix-cache hits: the chunks attend latents read back from cached pages)."""
    llm = LLM(model, ByteTokenizer(256), ops=f"mla={mla}", page_size=4, num_pages=400, max_num_seqs=4, max_model_len=320,
              long_prefill_token_threshold=16, enable_prefix_caching=True, prefix_match_unit=8, num_snapshot_slots=6)  # fmt: skip
    rng = random.Random(7)
    prefixes = [[rng.randrange(256) for _ in range(rng.randrange(150, 250))] for _ in range(2)]
    out = []
    try:
        for _ in range(2):
            prompts = [p + [rng.randrange(256) for _ in range(rng.randrange(1, 20))] for p in prefixes]
            out += [(list(o.token_ids), [lp.logprob for lp in o.outputs[0].logprobs or ()]) for o in llm.generate(prompts, GREEDY)]
            llm.engine.check_integrity()
        stats = llm.engine.stats().prefix_cache
        assert stats is not None and stats.hits > 0
    finally:
        llm.close()
    return out


def test_engine_chunked_prefill_and_prefix_hits_equal_the_reference_layer() -> None:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=11)
    model.eval()
    want, got = run(model, "naive"), run(model, "auto")
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(w[1]), atol=1e-4, rtol=0)


def test_engine_in_bf16_takes_the_latent_form_and_agrees_with_sized() -> None:
    """A bf16 model on CPU now resolves "auto" to the latent form (the "cpu_half" entry): the same tokens as the expanded
    "sized" form in bf16, logprobs within bf16's rounding (measured: 2e-3)."""
    model = K3ForCausalLM(debug())
    model.init_weights(seed=11)
    model.eval()
    model.to(torch.bfloat16)
    want, got = run(model, "sized"), run(model, "auto")
    assert [layer.self_attn.prefill for layer in model.model.layers if isinstance(layer.self_attn, GatedMLA)] == [mla_latent_flash] * len(
        model.config.mla_layers
    )
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g[1]), torch.tensor(w[1]), atol=1e-2, rtol=0)


def _peak_growth_bytes(fn) -> int:
    """Peak RSS over the RSS before `fn` (the kernel's high-water mark reset through /proc/self/clear_refs)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def test_a_chunks_working_memory_does_not_grow_with_the_context() -> None:
    """A 256-token chunk at 4k and at 256k context, demo-model sizes (H 4, Lr 64, Dr 32), fp32 and bf16: nothing past the
    inputs grows with the context but what the kernel tiles and packs (one key block's in bf16); expanded K/V alone would
    be 512 MiB at 256k."""
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the peak RSS")
    h, dn, dr, dv, lr, t = 4, 32, 32, 64, 64, 256
    for dtype in (torch.float32, torch.bfloat16):  # bf16: torch's kernel packs a call's keys whole, so the prefix goes in blocks
        growth = {}
        for s in (4096, 262144):
            c, k_pe = torch.randn(s, lr + dr).to(dtype).split([lr, dr], dim=-1)  # as the model passes them: one buffer from the pages
            q_nope, q_pe = torch.randn(t, h, dn).to(dtype), torch.randn(t, h, dr).to(dtype)
            w_uk, w_uv = (torch.randn(h, dn, lr) * 0.1).to(dtype), (torch.randn(h, dv, lr) * 0.1).to(dtype)
            with torch.no_grad():
                growth[s] = _peak_growth_bytes(lambda: mla_latent_flash(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.1, s - t))  # noqa: B023
        # bf16: one key block packed (~24 MiB at 64k keys) where one call over the prefix packed ~96 MiB at 256k (and 384 MiB at 1M)
        assert growth[262144] - growth[4096] < 48 * 2**20, (dtype, growth)
