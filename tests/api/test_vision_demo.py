"""The shipped demo model sees: `openk3/assets/tiny` with its trained vision tower, served as `openk3 serve` serves it (the
folder's chat encoding and preprocessor_config.json), answers "Describe the image." about fixed generated pictures that
training never drew (seed 2026) with their caption ("two red circles"), thinking off, through the official `openai` client
with `data:` URL image parts.

What is asserted is what the model card's held-out table supports: the exact caption for the pictures of this fixed set the
shipped weights caption right (measured, listed in RIGHT), and that the set's replies are not one constant answer."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import pytest

from openk3.api.chat_loading import load_chat_template
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.serve.config import EngineConfig
from openk3.serve.loading import ASSETS
from openk3.serve.tokenizer import HFTokenizer
from openk3.serve.vision_processor import read_media_config
from openk3.train.shapes import pictures
from tests.api.conftest import serve_app, stop_server

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")
pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) draws and decodes the pictures")

TINY = ASSETS / "tiny"
PICTURES = pictures(seed=2026, n=12)  # fixed pictures, never seen in training (training drew seed 0 and seeds from 1_000_003 on)
# the pictures the shipped weights caption exactly: 11 of the 12 (picture 6, "one blue circle", gets "one blue square"; the card's
# held-out table: 94% exact captions, the misses all in the shape)
RIGHT = (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11)
QUESTION = "Describe the image."
THINKING_OFF = {"chat_template_kwargs": {"thinking": False}}  # the tower was trained on K3's prompt without thinking


@pytest.fixture(scope="module")
def client(torch_one_thread) -> Iterator:
    engine = build_engine(EngineSpec(str(TINY), EngineConfig(max_model_len=1024, max_num_seqs=4))).local
    config = ServerConfig(ModelIdentity("tiny", "tiny"), media=read_media_config(TINY))
    server = serve_app(create_app(engine, engine.tokenizer, load_chat_template(TINY), config))
    try:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    finally:
        stop_server(server)


def ask(client, png: bytes | None):
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if png is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}})
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0, extra_body=THINKING_OFF)


@pytest.fixture(scope="module")
def captions(client) -> list[str]:
    return [ask(client, pic.png).choices[0].message.content.strip() for pic in PICTURES]


def test_the_shipped_folder_takes_images() -> None:
    media = read_media_config(TINY)
    assert media is not None and (media.patch_size, media.merge_kernel_size, media.patch_limit_on_one_side) == (14, 2, 8)


@pytest.mark.parametrize("index", RIGHT)
def test_the_demo_model_captions_a_held_out_picture(captions: list[str], index: int) -> None:
    assert captions[index] == PICTURES[index].caption, (index, captions)


def test_different_pictures_get_different_captions(captions: list[str]) -> None:
    # a constant reply, or one that ignores the picture, fails: the set has pictures of every colour
    assert len({pic.colour for pic in PICTURES}) == 4
    assert len(set(captions)) >= 4, captions


def test_usage_counts_the_images_tokens(client) -> None:
    from PIL import Image

    side = Image.open(io.BytesIO(PICTURES[0].png)).size
    marker_text = HFTokenizer(TINY).encode(f"image {side[0]}x{side[1]}")  # K3's marker: begin, this text, content, the pads, end
    with_image, without = ask(client, PICTURES[0].png).usage, ask(client, None).usage
    assert with_image.prompt_tokens - without.prompt_tokens == 3 + len(marker_text) + 16  # 8 x 8 patches merged 2 x 2: 16 pads
