"""Images through the engine (debug text model + a tiny random MoonViT tower, fp32): greedy tokens and their logprobs equal a
plain cache-free forward of the model with the image embeddings merged at the placeholders, whole and with the prefill
cut inside an image; the encoder runs once per image; the prefix cache hits on the same image and misses on another."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.model.batch import ForwardBatch
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.media_prompt import ImageSpan, expand_media
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from openk3.serve.vision_processor import ImageInput
from tests.serve.vision_fakes import PATCH, tiny_vision_model

PAD = 250  # the media placeholder id of this test (any id of the debug vocabulary)
GREEDY = SamplingParams(temperature=0, max_tokens=4, logprobs=0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return tiny_vision_model()


def image(seed: int, h: int, w: int) -> ImageInput:
    pixels = torch.randn(h * w, 3, PATCH, PATCH, generator=torch.Generator().manual_seed(seed))
    return ImageInput(pixels, (1, h, w), (h // 2) * (w // 2), w * PATCH, h * PATCH, seed.to_bytes(16, "little"))


def prompt(images: list[ImageInput], text: list[int] | None = None) -> tuple[list[int], tuple[ImageSpan, ...]]:
    base = text or [10, 11, 12, PAD, 13, 14, 15, 16, 17, PAD, 18, 19, 20, 21]
    return expand_media(base, PAD, images)


def reference(model: K3ForCausalLM, ids: list[int], spans: tuple[ImageSpan, ...], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forwards of the whole sequence with the image embeddings merged."""
    emb = model.encode_images(torch.cat([s.image.pixels for s in spans]), [s.image.grid for s in spans])
    rows = torch.tensor([p for s in spans for p in range(s.start, s.end)])
    seq, out, lps = list(ids), [], []
    with torch.no_grad():
        for _ in range(steps):
            batch = ForwardBatch.from_tokens(torch.tensor([seq]))
            logits = model(ForwardBatch(batch.input_ids, batch.positions, batch.cu_seqlens, batch.context_lens, mm_embeds=emb, mm_rows=rows))
            logp = torch.log_softmax(logits[-1].float(), -1)
            t = int(logp.argmax())
            out.append(t)
            lps.append(float(logp[t]))
            seq.append(t)
    return out, lps


def run(engine: LLMEngine, rid: str, ids: list[int], spans: tuple[ImageSpan, ...]) -> tuple[list[int], list[float], int]:
    engine.add_request(rid, ids, GREEDY, images=spans)
    tokens: list[int] = []
    lps: list[float] = []
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
            lps.extend(lp.logprob for lp in o.new_logprobs or ())
            cached = o.num_cached_tokens
    return tokens, lps, cached


def engine(model: K3ForCausalLM, **cfg) -> LLMEngine:
    base = dict(page_size=4, num_pages=64, max_num_seqs=4, max_model_len=128)
    return LLMEngine(model, ByteTokenizer(256), EngineConfig(**{**base, **cfg}))


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "cut-inside-images"])
def test_engine_equals_a_full_forward_with_merged_embeddings(model, chunk) -> None:
    a, b = image(1, 4, 6), image(2, 2, 4)
    ids, spans = prompt([a, b])
    assert [(s.start, s.end) for s in spans] == [(3, 9), (14, 16)]
    want_tokens, want_lps = reference(model, ids, spans, GREEDY.max_tokens or 0)
    e = engine(model, long_prefill_token_threshold=chunk)
    tokens, lps, _ = run(e, "r", ids, spans)
    assert tokens == want_tokens
    assert torch.allclose(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4)
    assert e.encoder_cache is not None and e.encoder_cache.encoded_images == 2  # once per image, even across chunks
    e.check_integrity()


def test_merge_changes_the_output(model) -> None:
    a = image(1, 4, 6)
    ids, spans = prompt([a, image(2, 2, 4)])
    with torch.no_grad():
        plain = model(ForwardBatch.from_tokens(torch.tensor([ids])))[-1]
    _, lps = reference(model, ids, spans, 1)
    assert not torch.allclose(torch.log_softmax(plain, -1).max(), torch.tensor(lps[0]), atol=1e-3)


def test_prefix_cache_hits_the_same_image_and_misses_another(model) -> None:
    e = engine(model, enable_prefix_caching=True, prefix_match_unit=4, num_snapshot_slots=8, long_prefill_token_threshold=8)
    text = [10, 11, 12, 13, 14, 15, 16, 17, PAD] + list(range(30, 50))
    a, b = image(1, 4, 6), image(3, 4, 6)
    ids_a, spans_a = prompt([a], text)
    first = run(e, "a1", ids_a, spans_a)
    again = run(e, "a2", ids_a, spans_a)
    assert again[2] > spans_a[0].end  # hit past the image
    assert again[0] == first[0] and torch.allclose(torch.tensor(again[1]), torch.tensor(first[1]), atol=1e-4)
    ids_b, spans_b = prompt([b], text)
    assert ids_b == ids_a  # the same token ids: only the image differs
    other = run(e, "b", ids_b, spans_b)
    assert other[2] <= spans_b[0].start  # no cached prefix past where the images differ
    want_tokens, want_lps = reference(model, ids_b, spans_b, GREEDY.max_tokens or 0)
    assert other[0] == want_tokens
    assert torch.allclose(torch.tensor(other[1]), torch.tensor(want_lps), atol=1e-4)
    e.check_integrity()


def test_a_text_model_refuses_images() -> None:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=1)
    ids, spans = prompt([image(1, 4, 6)], [10, PAD, 11])
    with pytest.raises(ValueError, match="no vision tower"):
        engine(m).add_request("x", ids, GREEDY, images=spans)


def test_bad_spans_are_refused(model) -> None:
    ids, spans = prompt([image(1, 4, 6)], [10, PAD, 11])
    with pytest.raises(ValueError, match="leave the prompt"):
        engine(model).add_request("x", ids[:4], GREEDY, images=spans)
    with pytest.raises(ValueError, match="2 media placeholders for 1 images"):
        expand_media([PAD, PAD], PAD, [image(1, 4, 6)])


def test_a_chunk_with_an_image_to_encode_spends_its_tokens_of_the_budget(model) -> None:
    e = engine(model, max_num_batched_tokens=40)
    ids, spans = prompt([image(1, 4, 6)], [10, 11, 12, PAD] + list(range(30, 55)))  # 29 + 5 = 34 tokens, an image of 6
    e.add_request("img", ids, GREEDY, images=spans)
    e.add_request("text", list(range(60, 80)), GREEDY)
    first = e.scheduler.schedule()
    # 34 tokens + 6 for the encoder leave nothing for "text" (without the charge it would get 6 tokens)
    assert [r.request_id for r in first.requests] == ["img"] and first.num_tokens == (34,)
    e.runner.execute(first)
    assert e.encoder_cache is not None and e.encoder_cache.cost(e.scheduler.running[0], 1) == 0  # ... and now it is cached
