"""What stands between a browser and a change: the action token, CSRF and the response headers.

Invariants:
- A GET never changes anything: every action is a POST (routes in pglane.web.app).
- A POST changes something only when the page runs with actions allowed, its CSRF field matches the
  browser's CSRF cookie under this process's secret, and it carries the action token; otherwise 403
  before the database is touched.
- The CSRF secret lives in this process only (``Guard.secret``, made at start): a restart voids every
  form, which costs a reload. The field is an HMAC of the browser's random cookie, the action and its
  target, so a field is good for one action on one target from one browser.
- A request whose Host header is not one the page was started for gets 400 (HostCheck): every bind
  has the check (pglane.web.server), loopback ones for the loopback names and their port.
- A POST is refused before its body is read unless actions are allowed and it is a small urlencoded
  form (pglane.web.app's act): nothing a client sends is spooled to disk.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.datastructures import MutableHeaders
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigurationError

CSRF_COOKIE = "pglane_csrf"
MIN_TOKEN_LENGTH = 16

# No script but our own file, no style but our own sheet, no frames, forms only to this page.
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def check_token(token: str | None, allow_actions: bool) -> str | None:
    """The action token to require, or None when the page is read-only; ConfigurationError when actions
    are asked for without a usable token."""
    if not allow_actions:
        return None
    token = (token or "").strip()
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"--allow-actions needs a token of at least {MIN_TOKEN_LENGTH} characters in PGLANE_WEB_TOKEN or"
            " --token-file; make one with: python3 -c 'import secrets; print(secrets.token_urlsafe())'"
        )
    return token


@dataclass
class Guard:
    """Checks the POSTs of one server process. ``token`` None: read-only, every POST refused."""

    token: str | None
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    @property
    def actions_allowed(self) -> bool:
        return self.token is not None

    @staticmethod
    def new_cookie() -> str:
        return secrets.token_urlsafe(32)

    def csrf_field(self, cookie: str, action: str, target: str) -> str:
        message = "\0".join((cookie, action, target)).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def refusal(self, *, cookie: str | None, csrf: str | None, token: str | None, action: str,
                target: str) -> str | None:
        """Why this POST is refused (one line for the 403 page), or None when it may go ahead."""
        if self.token is None:
            return "this page is read-only: start it with --allow-actions and a token to allow actions"
        if not cookie or not csrf or not hmac.compare_digest(csrf, self.csrf_field(cookie, action, target)):
            return "the form is stale or did not come from this page (CSRF check failed): open it again and confirm"
        if not token or not hmac.compare_digest(token.encode(), self.token.encode()):
            return "a missing or wrong action token: nothing was done"
        return None


class SecurityHeaders:
    """ASGI middleware adding HEADERS to every HTTP response (pages, fragments, static files, errors)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def host_and_port(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an allowed-hosts entry) as (lower-case name, port or None): ``name``,
    ``name:port``, ``[v6 address]`` or ``[v6 address]:port``; None when it is none of these."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 2:
            return None
        name, rest = value[:end + 1], value[end + 1:]
    else:
        name, colon, port_text = value.partition(":")
        rest = colon + port_text
    if not name or any(c in name for c in "/@\\ "):
        return None
    if not rest:
        return name, None
    port = rest[1:]
    if rest[0] != ":" or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    return name, int(port)


class HostCheck:
    """ASGI middleware answering only the Host headers in ``allowed`` (each NAME, any port, or NAME:PORT);
    400 for any other and for none, before the application runs. So a web site that rebinds its own DNS
    name to this page's address (DNS rebinding) gets 400, not the page: its requests carry its name.
    ``allowed`` None: every Host (the application embedded behind something that checks it already)."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str] | None) -> None:
        self.app = app
        self.allowed: set[tuple[str, int | None]] | None = None
        if allowed is not None:
            self.allowed = set()
            for entry in allowed:
                parsed = host_and_port(entry)
                if parsed is None:
                    raise ConfigurationError(f"{entry!r} is not a host name, NAME:PORT or [IPv6]:PORT")
                self.allowed.add(parsed)

    def allows(self, host: str | None) -> bool:
        if self.allowed is None:
            return True
        parsed = host_and_port(host or "")
        return parsed is not None and (parsed in self.allowed or (parsed[0], None) in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.allowed is not None:
            hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            if len(hosts) != 1 or not self.allows(hosts[0]):
                response = PlainTextResponse(
                    "400: this page answers only the host names it was started for (its Host check)", 400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
