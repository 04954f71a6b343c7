"""``pglane web``: read the token, bind the socket, serve the page with uvicorn.

The socket is bound here, before uvicorn starts, so that ``--port 0`` takes a free port and the line
``pglane web on http://HOST:PORT/`` names the real one (tests and scripts read it).
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
# The Host headers a page listening on loopback answers: a browser on this machine, or a reverse proxy
# passing its upstream's address (nginx's default). A DNS name rebound to 127.0.0.1 gets 400.
LOOPBACK_NAMES = ("127.0.0.1", "localhost")


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
    shown = f"[{host}]" if ":" in host else host
    print(f"pglane web on http://{shown}:{port}/ ({'actions allowed with the token' if token else 'read-only'})",
          file=sys.stderr, flush=True)
    loopback = ipaddress.ip_address(host).is_loopback
    if not loopback:
        print(f"pglane web: listening on {host}, beyond this machine: put a reverse proxy that authenticates "
              "people in front of it", file=sys.stderr)
    # A loopback page answers loopback names only (IPv4: Starlette's host check cannot parse "[::1]:PORT").
    allowed = LOOPBACK_NAMES if loopback and ":" not in host else None
    config = uvicorn.Config(create_app(dsn, token=token, allowed_hosts=allowed), log_level="warning",
                            root_path=args.root_path or "",
                            proxy_headers=False, server_header=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
