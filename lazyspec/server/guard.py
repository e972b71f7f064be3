"""ASGI middleware that refuses requests before any handler runs: a ``Host`` allow-list
(``HostGuard``), and the API key and body-size limit (``RequestGuard``).

Both answer with the app's own error responses (``{"error": {...}}``) and never read a
body they refuse. ``create_app`` stacks them as HostGuard -> CORS (if enabled) ->
RequestGuard -> the app, so that a CORS preflight is answered without the API key and a
401 still carries the CORS headers a browser needs to read it.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lazyspec.server.limits import ApiError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # a 1M-token prompt of token ids is ~8 MB of JSON
PUBLIC_PATHS = ("/health",)  # answered without the API key (GET and HEAD)
# a refused body up to this many bytes is read and discarded before the 413 goes out, so the
# client (still sending) sees the answer instead of a reset connection; past it, no reading
DRAIN_BYTES = 64 * 2**20

ErrorResponse = Callable[[ApiError], Response]


def is_loopback(address: str) -> bool:
    """Whether binding ``address`` (``--host``) serves only this machine."""
    if address.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def split_list(value: str | None) -> tuple[str, ...]:
    """A comma list flag (``a, b,c``) -> ``("a", "b", "c")``; None -> ()."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def host_name(header: str) -> str:
    """A ``Host`` header without its port, lower-case: ``[::1]:8000`` -> ``[::1]``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def check_json_content_type(value: str | None) -> None:
    """415 unless ``value`` is ``application/json`` (parameters allowed). Browsers send a
    cross-origin POST without a preflight only for form and text/plain bodies, so requiring
    JSON keeps an arbitrary web page from driving the server."""
    media_type = (value or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            f"Content-Type must be application/json, got {value!r}",
            status=415,
            code="unsupported_media_type",
        )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _refuse(
    error: ApiError, make: ErrorResponse, scope: Scope, send: Send, **headers
) -> None:
    response = make(error)
    response.headers.update(headers)

    async def no_body() -> Message:  # the refused body is never read
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)


async def _discard_body(receive: Receive) -> None:
    """Read the request body to its end (or the client's disconnect), keeping none of it."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class HostGuard:
    """Refuses a request whose ``Host`` is not allowed: with a page on ``evil.example``
    rebound to 127.0.0.1 by DNS, a browser sends ``Host: evil.example``. ``allowed`` holds
    host names (no port; ``*`` allows any)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...], error_response: ErrorResponse):
        self.app = app
        self.allowed = frozenset(host_name(h) for h in allowed)
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        if host is not None and host_name(host) in self.allowed:
            return await self.app(scope, receive, send)
        # 400, not 421: a client may retry a 421 on another connection, which cannot help
        said = "the request has no Host header" if host is None else f"Host {host!r} is not allowed"
        error = ApiError(
            f"{said}; start the server with --allowed-hosts to allow it", code="host_not_allowed"
        )
        await _refuse(error, self.error_response, scope, send)


class RequestGuard:
    """The API key (``Authorization: Bearer KEY``; every path but ``/health``) and the body
    limit: 413 when ``Content-Length`` exceeds ``max_request_bytes``, or when a chunked body
    grows past it while the handler reads it (``ApiError`` raised from ``receive``, which the
    app answers); nothing beyond the limit is buffered."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_request_bytes: int,
        error_response: ErrorResponse,
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.api_key = None if api_key is None else api_key.encode("utf-8")
        self.max_request_bytes = max_request_bytes
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and not self._same_or_allowed_origin(scope):
            error = ApiError(
                f"cross-origin POST from {_header(scope, b'origin')!r} refused; start the "
                "server with --allowed-origins to allow that origin",
                status=403,
                code="origin_not_allowed",
            )
            await _refuse(error, self.error_response, scope, send)
            return
        if not self._authorized(scope):
            error = ApiError("a valid API key is required", status=401, code="invalid_api_key")
            await _refuse(error, self.error_response, scope, send, **{"WWW-Authenticate": "Bearer"})
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            if int(length) <= DRAIN_BYTES:
                await _discard_body(receive)
            await _refuse(self._too_large(), self.error_response, scope, send, Connection="close")
            return
        await self.app(scope, self._counting(receive), send)

    def _same_or_allowed_origin(self, scope: Scope) -> bool:
        """A POST without ``Origin`` (not from a browser), from the server's own origin, or
        from one of ``allowed_origins``. Browsers send a form, text/plain or empty POST to
        another origin without a preflight, with an ``Origin`` header: refusing it here keeps
        a web page from changing the server's state (``/flush_cache``) or using it."""
        origin = _header(scope, b"origin")
        if origin is None or "*" in self.allowed_origins:
            return True
        origin = origin.strip().rstrip("/").lower()
        if origin in self.allowed_origins:
            return True
        host = (_header(scope, b"host") or "").strip().lower()
        return bool(host) and origin.partition("://")[2] == host

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        if scope["path"] in PUBLIC_PATHS and scope["method"] in ("GET", "HEAD"):
            return True
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        given = token.strip().encode("latin-1")
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.api_key)

    def _too_large(self) -> ApiError:
        return ApiError(
            f"the request body exceeds max_request_bytes={self.max_request_bytes}",
            status=413,
            code="request_too_large",
        )

    def _counting(self, receive: Receive) -> Callable[[], Awaitable[Message]]:
        num_bytes = 0

        async def counted() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_request_bytes:
                    raise self._too_large()
            return message

        return counted


def guard_stack(app: Any, settings: Any, error_response: ErrorResponse) -> None:
    """Add the guards (and CORS when ``settings.allowed_origins``) to the FastAPI ``app``;
    the last added runs first."""
    app.add_middleware(
        RequestGuard,
        api_key=settings.api_key,
        max_request_bytes=settings.max_request_bytes,
        error_response=error_response,
        allowed_origins=settings.allowed_origins,
    )
    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    if settings.allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=settings.allowed_hosts, error_response=error_response)
