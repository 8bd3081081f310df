"""Image URLs fetched from hosts the operator allows (`openk3 serve --allowed-media-domains`, vLLM's flag).

Off by default: a server started without the flag fetches nothing and an http(s) image URL is a 400 naming it. With it,
only http and https URLs whose host is on the list (exact names, compared lowercased without a trailing dot) are fetched;
the URL is parsed once and that parsed URL is what is requested, so what is checked is what is fetched. Redirects are
followed by hand, each hop checked against the same list (at most MAX_REDIRECTS). The body is read in pieces and dropped
past the request limit (--max-image-mb), so a large or endless response costs at most that many bytes; the whole fetch
has one deadline (--media-fetch-timeout-s). No proxy or netrc from the environment is used (trust_env off): what is
fetched depends on the flags only. Every failure -- a host not on the list, a status other than 200, a timeout, a
connection error, too many bytes -- is a 400 naming the part's url, never a 5xx: the client sent the URL.

Why a host list and not an IP check: the list is the operator's statement of which services the server may reach on a
client's behalf; an address check alone would still let clients reach anything public.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from openk3.api.errors import APIError

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class MediaFetchConfig:
    """Which hosts image URLs may name (empty: fetching off) and how long one image's fetch may take."""

    allowed_domains: tuple[str, ...] = ()
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"media fetch timeout_s={self.timeout_s}: expected > 0 (openk3 serve --media-fetch-timeout-s)")
        for name in self.allowed_domains:
            if not name or "/" in name or ":" in name or name != name.strip():
                raise ValueError(f"--allowed-media-domains {name!r}: expected a host name (example.com), without scheme, port or path")

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)

    def allows(self, url: httpx.URL) -> bool:
        host = url.host.lower().rstrip(".")
        return url.scheme in ("http", "https") and host in {d.lower().rstrip(".") for d in self.allowed_domains}


def _refuse(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


async def fetch_image(url_text: str, param: str, config: MediaFetchConfig, max_bytes: int) -> bytes:
    """The body of an allowed image URL, at most `max_bytes` (module docstring for every rule)."""
    try:
        url = httpx.URL(url_text.strip())
    except (httpx.InvalidURL, ValueError) as e:
        raise _refuse(param, f"not a valid URL: {e}") from None
    flag = "(openk3 serve --allowed-media-domains)"
    try:
        async with asyncio.timeout(config.timeout_s), httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                if not config.allows(url):
                    raise _refuse(param, f"fetching from {url.scheme}://{url.host} is not allowed on this server {flag}", "unsupported")
                async with client.stream("GET", url) as response:
                    if response.status_code in _REDIRECTS and "location" in response.headers:
                        url = url.join(response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise _refuse(param, f"fetching the image returned HTTP {response.status_code}", "media_fetch_failed")
                    return await _read_capped(response, param, max_bytes)
            raise _refuse(param, f"more than {MAX_REDIRECTS} redirects", "media_fetch_failed")
    except TimeoutError:
        why = f"fetching the image took longer than {config.timeout_s:g} s (openk3 serve --media-fetch-timeout-s)"
        raise _refuse(param, why, "media_fetch_failed") from None
    except httpx.HTTPError as e:
        raise _refuse(param, f"fetching the image failed: {type(e).__name__}", "media_fetch_failed") from None


async def _read_capped(response: httpx.Response, param: str, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length")
    limit = f"more than this server's limit of {max_bytes} (openk3 serve --max-image-mb)"
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _refuse(param, f"the image is {declared} bytes, {limit}", "image_too_large")
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > max_bytes:
            raise _refuse(param, f"the image is over {max_bytes} bytes, {limit}", "image_too_large")
    return bytes(body)


async def fetch_all(urls: Sequence[tuple[str, str]], config: MediaFetchConfig, max_bytes: int) -> list[bytes]:
    """(url, param) pairs fetched concurrently, in order; the first failure (in request order) is the answer."""
    results = await asyncio.gather(*(fetch_image(u, p, config, max_bytes) for u, p in urls), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, bytes)]
