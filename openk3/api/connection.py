"""ConnectionConfig: what one HTTP connection may cost the server -- uvicorn's own bounds, the app's body-read deadline, and
which web origins may call it (CORS). Each is an `openk3 serve` flag (openk3/options.py declarations).

What bounds what: uvicorn closes a connection idle between requests after `timeout_keep_alive`, refuses a request head
larger than `h11_max_incomplete_event_size` bytes (400), and answers 503 once `limit_concurrency` connections or tasks are
open. It has no deadline for a slow request head (a client trickling header bytes holds its connection, and one unit of
`limit_concurrency`, until it stops), and none for the body: the app bounds the body with `body_read_timeout_s` (408).
Slow heads need a reverse proxy in front (nginx `client_header_timeout`) when the server faces untrusted clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openk3.options import check_settings, setting

UVICORN_H11_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024  # uvicorn's own default, kept


@dataclass(frozen=True)
class ConnectionConfig:
    timeout_keep_alive: float = setting(5.0, "seconds an idle keep-alive connection stays open between requests (uvicorn)", low=0)
    limit_concurrency: int = setting(1024, "most open connections or requests before new requests get 503 (uvicorn; streams count too)", low=1)
    h11_max_incomplete_event_size: int = setting(
        UVICORN_H11_MAX_INCOMPLETE_EVENT_SIZE, "largest request line + headers accepted, in bytes (uvicorn; larger: 400)", low=1024
    )
    body_read_timeout_s: float = setting(30.0, "seconds a client may take to send its request body (longer: HTTP 408)", low=0.01)
    allowed_origins: str | None = setting(None, "comma-separated web origins allowed to call the API from a browser (CORS), or '*' for any (default: none)")

    def __post_init__(self) -> None:
        check_settings(self)
        for origin in self.origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"ConnectionConfig.allowed_origins has {origin!r}: expected '*' or origins like https://host[:port]")

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(o.strip().rstrip("/") for o in (self.allowed_origins or "").split(",") if o.strip())

    def uvicorn_options(self) -> dict[str, Any]:
        """The keyword arguments of uvicorn.run / uvicorn.Config these settings stand for."""
        return {
            "timeout_keep_alive": self.timeout_keep_alive,
            "limit_concurrency": self.limit_concurrency,
            "h11_max_incomplete_event_size": self.h11_max_incomplete_event_size,
            "http": "h11",  # the option above is h11's; httptools (when installed) would ignore it
        }
