"""Image URLs fetched from hosts the operator allows (--allowed-media-domains, api/media_fetch.py), through the server with
the official `openai` client: an allowed URL gives the same prompt and reply as the same bytes sent as a data: URL; a host
not on the list (directly, through a redirect, or hidden behind userinfo), a status other than 200, a body over the byte
limit (declared or streamed), a fetch past its deadline are each a 400 naming the part's url."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openk3.api.chat_k3 import K3Template
from openk3.api.limits import RequestLimits
from openk3.api.media_fetch import MediaFetchConfig
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.serve.engine import EngineConfig, LLMEngine
from tests.api.conftest import serve_app, stop_server
from tests.serve.vision_fakes import MEDIA, MediaByteTokenizer, tiny_vision_model

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")
Image = pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) decodes images")

MAX_BYTES = 4000
PART = "messages[0].content[1].image_url.url"


def png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (30, 20), colour).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE = png((250, 0, 0)), png((0, 0, 250))


class ImageHost:
    """A local web server with the cases the tests need; `/hang` answers only when the test ends (`release`)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                port = host.port
                routes = {
                    "/red.png": (200, {"Content-Type": "image/png"}, RED),
                    "/blue.png": (200, {"Content-Type": "image/png"}, BLUE),
                    "/to-red": (302, {"Location": "/red.png"}, b""),
                    "/to-other-host": (302, {"Location": f"http://localhost:{port}/red.png"}, b""),
                    "/loop": (302, {"Location": "/loop"}, b""),
                    "/big-declared": (200, {"Content-Length": str(MAX_BYTES + 1)}, b""),
                }
                if self.path == "/hang":
                    host.release.wait(30)
                    return
                if self.path == "/endless":  # no length: a body that only the reader's cap stops
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for _ in range(1000):
                            self.wfile.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    return
                status, headers, body = routes.get(self.path, (404, {}, b"no"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    h = ImageHost()
    yield h
    h.close()


@pytest.fixture(scope="module")
def client(torch_one_thread, host):
    tok = MediaByteTokenizer()
    engine = LLMEngine(tiny_vision_model(), tok, EngineConfig(num_pages=256, page_size=8, max_num_seqs=4, max_model_len=1024))
    fetch = MediaFetchConfig(allowed_domains=("127.0.0.1",), timeout_s=1.0)  # /hang only: every other case answers at once
    limits = RequestLimits(max_images_per_request=2, max_image_bytes=MAX_BYTES, max_image_pixels=5000)
    config = ServerConfig(ModelIdentity("k3v", "k3v"), media=MEDIA, limits=limits, media_fetch=fetch)
    server = serve_app(create_app(engine, tok, K3Template("K3's encoding (test)"), config))
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    stop_server(server)


def ask(client, url: str):
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return client.chat.completions.create(model="k3v", messages=[{"role": "user", "content": content}], max_tokens=3, temperature=0, logprobs=True)


def data_url(body: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(body).decode()


def test_an_allowed_url_is_the_same_image_as_its_bytes_inline(client, host) -> None:
    fetched, inline = ask(client, host.url + "/red.png"), ask(client, data_url(RED))
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    assert fetched.choices[0].logprobs.content[0].logprob == pytest.approx(inline.choices[0].logprobs.content[0].logprob, abs=1e-5)
    other = ask(client, host.url + "/blue.png")  # the fetched bytes are what is seen
    assert other.choices[0].logprobs.content[0].logprob != pytest.approx(fetched.choices[0].logprobs.content[0].logprob, abs=1e-5)
    redirected = ask(client, host.url + "/to-red")  # a redirect on an allowed host is followed
    assert redirected.choices[0].logprobs.content[0].logprob == pytest.approx(fetched.choices[0].logprobs.content[0].logprob, abs=1e-5)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("http://localhost:{port}/red.png", "fetching from http://localhost is not allowed"),
        ("{url}/to-other-host", "fetching from http://localhost is not allowed"),  # each redirect hop is checked
        ("http://127.0.0.1@localhost:{port}/red.png", "fetching from http://localhost is not allowed"),  # userinfo is not the host
        ("ftp://127.0.0.1/red.png", "expected a data URL"),
        ("{url}/missing.png", "returned HTTP 404"),
        ("{url}/loop", "more than 5 redirects"),
        ("{url}/big-declared", "--max-image-mb"),
        ("{url}/endless", "--max-image-mb"),
        ("{url}/hang", "--media-fetch-timeout-s"),
    ],
)
def test_each_refused_fetch_is_a_400_naming_the_url(client, host, path, words) -> None:
    url = path.format(url=host.url, port=host.port)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url)
    body = e.value.body
    assert body["param"] == PART and words in body["message"], body


def test_fetch_settings_are_checked() -> None:
    assert not MediaFetchConfig().enabled
    for bad in ("http://example.com", "example.com/x", "example.com:80", ""):
        with pytest.raises(ValueError, match="expected a host name"):
            MediaFetchConfig(allowed_domains=(bad,))
    with pytest.raises(ValueError, match="--media-fetch-timeout-s"):
        MediaFetchConfig(allowed_domains=("example.com",), timeout_s=0)
