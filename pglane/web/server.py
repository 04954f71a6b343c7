"""``pglane web``: read the token, bind the socket, serve the page with uvicorn.

The socket is bound here, before uvicorn starts, so that ``--port 0`` takes a free port and the line
``pglane web on http://HOST:PORT/`` names the real one (tests and scripts read it).

Every bind has a Host check (pglane.web.security.HostCheck): on loopback (127.0.0.1, ::1, localhost)
the page answers Host 127.0.0.1, localhost and [::1] with its port; beyond loopback it answers only the
names given in $PGLANE_WEB_ALLOWED_HOSTS (comma-separated NAME or NAME:PORT; or an ``allowed_host``
list on the parsed arguments, when the command has such an option), and refuses to start without one.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

import uvicorn

from ..errors import ConfigurationError
from .app import create_app
from .security import check_token

TOKEN_ENV = "PGLANE_WEB_TOKEN"
ALLOWED_HOSTS_ENV = "PGLANE_WEB_ALLOWED_HOSTS"
# The Host names a page listening on loopback answers (with its port): a browser on this machine, or a
# reverse proxy passing its upstream's address (nginx's default). A DNS name rebound to loopback gets 400.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def allowed_hosts(host: str, port: int, loopback: bool, extra: list[str]) -> list[str]:
    """The Host headers the page answers when bound to host:port; ConfigurationError beyond loopback
    without any named."""
    if loopback:
        names = [f"{name}:{port}" for name in LOOPBACK_NAMES]
        return names + (list(LOOPBACK_NAMES) if port == 80 else []) + extra
    if not extra:
        raise ConfigurationError(
            f"pglane web on {host}, beyond this machine, answers only the host names it is given: set "
            f"{ALLOWED_HOSTS_ENV}=NAME[:PORT],... to the names browsers and your proxy use for it")
    return extra


def extra_hosts(args: argparse.Namespace) -> list[str]:
    """The allowed host names given: the arguments' allowed_host list, then $PGLANE_WEB_ALLOWED_HOSTS."""
    given = [str(h) for h in (getattr(args, "allowed_host", None) or [])]
    given += os.environ.get(ALLOWED_HOSTS_ENV, "").split(",")
    return [h.strip() for h in given if h.strip()]


def read_token(token_file: str | None) -> str | None:
    """The action token: from --token-file (its first line) or $PGLANE_WEB_TOKEN; None when neither."""
    if token_file:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"cannot read --token-file {token_file} ({exc}); give a readable text file") from None
        return lines[0] if lines else ""
    return os.environ.get(TOKEN_ENV)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); a one-line error when it cannot be had."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigurationError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(dsn: str, args: argparse.Namespace) -> int:
    token = check_token(read_token(args.token_file), args.allow_actions)
    if token is None and (args.token_file or os.environ.get(TOKEN_ENV)):
        print("pglane web: a token is set but --allow-actions is not: the page is read-only", file=sys.stderr)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    try:
        allowed = allowed_hosts(host, port, loopback, extra_hosts(args))
        app = create_app(dsn, token=token, allowed_hosts=allowed)
    except ConfigurationError:
        sock.close()
        raise
    shown = f"[{host}]" if ":" in host else host
    print(f"pglane web on http://{shown}:{port}/ ({'actions allowed with the token' if token else 'read-only'})",
          file=sys.stderr, flush=True)
    if not loopback:
        guard = ("actions need the token and a CSRF-checked form" if token else "read-only: every POST refused")
        print(f"pglane web: listening on {host}, beyond this machine. What protects it: the Host check (answers "
              f"only Host {', '.join(allowed)}; others get 400); {guard}; no login of its own: put a reverse "
              "proxy that authenticates people in front of it", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning",
                            root_path=args.root_path or "",
                            proxy_headers=False, server_header=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
