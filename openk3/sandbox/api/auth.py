"""The HTTP service's API token: who may call a daemon that can run commands in every sandbox of its host.

With a key set, every request must carry `Authorization: Bearer <key>` (the scheme in any case); anything else is 401 with a JSON error body (the
clients raise Unauthorized). The comparison is constant-time (hmac.compare_digest) so response timing tells nothing about
how much of a guess was right. A daemon bound to an address other than loopback refuses to start without a key unless the
operator says so explicitly (`--no-api-key`, for a daemon behind an authenticating proxy).
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request
from fastapi.responses import JSONResponse

ENV_VAR = "OPENK3_SANDBOX_API_KEY"
MIN_KEY_CHARS = 16


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_serving(host: str, api_key: str | None, allow_no_key: bool) -> str | None:
    """Why the daemon must not start with these settings, or None when it may."""
    if api_key is not None and len(api_key) < MIN_KEY_CHARS:
        return f"the API key has {len(api_key)} characters; use at least {MIN_KEY_CHARS} (e.g. `openssl rand -hex 32`)"
    if api_key is None and not is_loopback(host) and not allow_no_key:
        return (
            f"--host {host} is not a loopback address and no API key is set: anyone who reaches it could run commands in every "
            f"sandbox; set {ENV_VAR} (or --api-key / --api-key-file), or pass --no-api-key behind an authenticating proxy"
        )
    return None


def bearer_token(header: str) -> str | None:
    """The credentials of an `Authorization: Bearer <token>` header, or None for any other scheme. RFC 7235: the scheme is
    case-insensitive (`bearer`, `BEARER`) and separated from the token by one or more spaces."""
    scheme, _, rest = header.partition(" ")
    token = rest.lstrip(" ")
    return token if scheme.lower() == "bearer" and token else None


def authorized(request: Request, api_key: str) -> bool:
    token = bearer_token(request.headers.get("authorization", ""))
    # Compared in full even when the scheme is wrong, so the time taken says nothing about the key.
    given = (token or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, api_key.encode()) and token is not None


def unauthorized() -> JSONResponse:
    body = {"error": {"type": "Unauthorized", "message": "missing or wrong API key: send the header `Authorization: Bearer <key>`"}}
    return JSONResponse(status_code=401, content=body, headers={"WWW-Authenticate": "Bearer"})
