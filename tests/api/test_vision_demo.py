"""The shipped demo model sees: `openk3/assets/tiny` with its trained vision tower, served as `openk3 serve` serves it (the
folder's chat encoding and preprocessor_config.json), answers a question about fixed generated pictures with a caption in
its format ("two red circles") that names the picture's colour, thinking off, through the official `openai` client. The
caption's count and shape are not asserted: the card's held-out table shows the tower does not get them reliably."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from openk3.api.chat_loading import load_chat_template
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.serve.config import EngineConfig
from openk3.serve.loading import ASSETS
from openk3.serve.vision_processor import read_media_config
from openk3.train.shapes import COUNTS, KINDS, pictures
from tests.api.conftest import serve_app, stop_server

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")
pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) draws and decodes the pictures")

TINY = ASSETS / "tiny"
PICTURES = pictures(seed=2026, n=3)  # fixed pictures, never seen in training (training drew seeds 0 and 1)


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


def test_the_shipped_folder_takes_images() -> None:
    media = read_media_config(TINY)
    assert media is not None and (media.patch_size, media.merge_kernel_size, media.patch_limit_on_one_side) == (14, 2, 8)


@pytest.mark.parametrize("index", range(len(PICTURES)))
def test_the_demo_model_names_the_colour_of_a_generated_picture(client, index: int) -> None:
    pic = PICTURES[index]
    url = "data:image/png;base64," + base64.b64encode(pic.png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What colour is the shape?"}]
    thinking_off = {"chat_template_kwargs": {"thinking": False}}  # the demo's tower was trained on K3's prompt without thinking
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0, extra_body=thinking_off)
    words = reply.choices[0].message.content.split()
    assert len(words) == 3 and words[0] in COUNTS and words[2].removesuffix("s") in KINDS, words
    assert words[1] == pic.colour, (words, pic.caption)
    assert reply.usage.prompt_tokens > 16  # the image's 16 media tokens and the text around them
