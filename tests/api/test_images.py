"""Image input through the server with the official `openai` client: a tiny K3 model with a random vision tower, K3's
encoding and a tokenizer with the media tokens. Chat `image_url` parts and Responses `input_image` items with data: URLs;
usage counts each image's media tokens; every limit and every malformed part is a 400 naming the part."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import pytest

from openk3.api.chat_k3 import K3Template
from openk3.api.limits import RequestLimits
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.vision_processor import resize_plan
from tests.api.conftest import serve_app, stop_server
from tests.serve.vision_fakes import MEDIA, MediaByteTokenizer, tiny_vision_model

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")
Image = pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) decodes images")

LIMITS = RequestLimits(max_images_per_request=2, max_image_bytes=4000, max_image_pixels=5000)


def data_url(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 60), fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def live(torch_one_thread) -> Iterator:
    tok = MediaByteTokenizer()
    engine = LLMEngine(tiny_vision_model(), tok, EngineConfig(num_pages=256, page_size=8, max_num_seqs=4, max_model_len=1024))
    config = ServerConfig(ModelIdentity("k3v", "k3v"), media=MEDIA, limits=LIMITS)
    server = serve_app(create_app(engine, tok, K3Template("K3's encoding (test)"), config))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def ask(client, *parts: dict, **kwargs):
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return client.chat.completions.create(model="k3v", messages=[{"role": "user", "content": content}], max_tokens=3, temperature=0, **kwargs)


def image_part(url: str, detail: str | None = None) -> dict:
    body = {"url": url} | ({"detail": detail} if detail else {})
    return {"type": "image_url", "image_url": body}


def test_an_image_costs_its_marker_and_its_media_tokens(client) -> None:
    plain = ask(client).usage.prompt_tokens
    got = ask(client, image_part(data_url((30, 20))))
    tokens = resize_plan(30, 20, MEDIA).num_tokens
    assert tokens == 20  # 30 x 20 pixels, 3-pixel patches: 10 x 7 patches padded to 10 x 8, merged 2 x 2
    marker = 1 + len(b"image 30x20") + 1 + 1  # <|media_begin|>image 30x20<|media_content|> ... <|media_end|>
    assert got.usage.prompt_tokens == plain + marker + tokens
    assert got.choices[0].finish_reason == "length"
    low = ask(client, image_part(data_url((60, 45)), "low"))  # 60 x 45 fits 64 patches at any detail here
    assert low.usage.prompt_tokens == plain + 1 + len(b"image 60x45") + 2 + resize_plan(60, 45, MEDIA).num_tokens


def test_the_image_decides_the_reply_and_the_same_image_the_same_reply(client) -> None:
    a, b = data_url((30, 20), (250, 0, 0)), data_url((30, 20), (0, 0, 250))
    first = [ask(client, image_part(a), logprobs=True).choices[0].logprobs.content[0].logprob for _ in range(2)]
    other = ask(client, image_part(b), logprobs=True).choices[0].logprobs.content[0].logprob
    assert first[0] == pytest.approx(first[1], abs=1e-5)
    assert other != pytest.approx(first[0], abs=1e-5)


def test_input_image_in_the_responses_api(client) -> None:
    url = data_url((30, 20))
    content = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url, "detail": "auto"}]
    r = client.responses.create(model="k3v", input=[{"role": "user", "content": content}], max_output_tokens=3, temperature=0)
    chat = ask(client, image_part(url))
    assert r.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize(
    ("parts", "param", "words"),
    [
        ([image_part("https://example.com/cat.png")], "messages[0].content[1].image_url.url", "only data: URLs"),
        ([image_part("data:image/png;base64,%%%")], "messages[0].content[1].image_url.url", "malformed"),
        ([image_part("data:text/plain;base64,aGk=")], "messages[0].content[1].image_url.url", "not an image type"),
        ([image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())], "messages[0].content[1].image_url", "could not be decoded"),
        ([image_part(data_url((30, 20)), "ultra")], "messages[0].content[1].image_url.detail", "detail 'ultra'"),
        ([image_part(data_url((30, 20)))] * 3, "messages[0].content[3].image_url", "--max-images-per-request"),
        ([image_part(data_url((80, 70)))], "messages[0].content[1].image_url", "--max-image-pixels"),
        ([image_part(data_url((60, 60), fmt="BMP"))], "messages[0].content[1].image_url", "--max-image-mb"),
        ([{"type": "image_url", "image_url": {"url": data_url((9, 9)), "size": 3}}], "messages[0].content[1].image_url", "expected an object"),
    ],
)
def test_each_bad_image_is_a_400_naming_it(client, parts, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, *parts)
    body = e.value.body
    assert body["param"] == param and words in body["message"], body


def test_images_only_in_user_messages(client) -> None:
    messages = [{"role": "system", "content": [image_part(data_url((9, 9)))]}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="user messages only"):
        client.chat.completions.create(model="k3v", messages=messages, max_tokens=1)


def test_server_is_clean_afterwards(live) -> None:
    engine = live.frontend.engine
    assert live.in_loop(live.frontend.call(lambda e: e.check_integrity())) is None
    assert engine.encoder_cache is not None and engine.encoder_cache.encoded_images >= 3
