"""A loopback TCP proxy that tests steer, to put network faults between pglane (workers, clients) and the
real PostgreSQL server.

    with NetProxy.for_dsn(dsn) as proxy:
        worker_dsn = proxy.dsn_through(dsn)     # host 127.0.0.1, port proxy.port
        ...                                      # start workers on worker_dsn
        proxy.blackhole()                        # the network goes silent
        ...
        proxy.forward()                          # and heals

One background thread runs a ``selectors`` loop over every connection; no third-party code. Each accepted
client connection gets its own connection to the target: TCP, or the Unix socket ``<dir>/.s.PGSQL.<port>``
when the target host is a directory (as in libpq). Every control call (a mode, ``reset()``,
``refuse_new()``) runs inside that loop and returns once it is in effect: after ``blackhole()`` returns,
not one more byte is forwarded. A mode set on the proxy applies to every current connection and to every
later one (and replaces a connection's own mode); ``proxy.connections`` lists the open connections, each
of which takes a mode of its own as well.

What each mode imitates, and its limits:

``forward()``
    A healthy network: bytes go both ways as soon as they arrive, EOF (FIN) and resets are passed on.

``blackhole()``
    A silent partition: packets lost in both directions, nothing closed, no error to either side. The
    proxy *stops reading* (it does not read and drop): the bytes a peer sends wait in the kernels' socket
    buffers, the peer's ``send()`` blocks once those are full, and a FIN or an RST that a peer sends in
    the meantime is not seen either. This is what TCP does over a partition that heals before it gives
    up: it retransmits, so after ``forward()`` every connection resumes exactly where it stopped, in
    order, nothing lost, and a query sent during the partition completes. (Reading and dropping would
    instead corrupt the stream, which a real network never does to TCP.) A connection accepted during a
    blackhole is connected to the target but nothing flows on it.
    Limit: the peers' kernels still talk to the proxy's kernel, on loopback. TCP keepalive probes are
    answered, so ``keepalives_*`` never end a connection; ``tcp_user_timeout`` cannot fire while the
    proxy's receive buffer (megabytes on loopback) has room; and a new connection completes its TCP
    handshake (then gets no answer, which libpq's ``connect_timeout`` ends just the same). Only deadlines
    kept above TCP notice: the client's own timeouts, the server's (``statement_timeout``, a lease
    expiring) or an operator ending the session (``pg_terminate_backend``). To test kernel-level liveness,
    drop packets with a firewall in a network namespace instead.

``one_way("to_server")`` / ``one_way("to_client")``
    An asymmetric partition: the direction named stops (as in a blackhole: held, not dropped), the other
    still flows. ``one_way("to_server")``: the server never receives the queries, the client keeps
    receiving whatever the server sends (NOTIFY, an error as the session ends). ``one_way("to_client")``:
    the server runs every query (its effects, locks and commits happen) but the client hears nothing.

``latency(seconds)``
    A slow link: every chunk the proxy reads is written on at least ``seconds`` after it arrived, in
    both directions (a round trip takes at least twice ``seconds``), in order. No bandwidth limit, no
    jitter, no loss; a chunk is what one ``recv()`` returns (at most 64 KiB). A change of mode applies to
    the chunks already waiting: ``forward()`` sends them at once, still in order.

``reset()`` (an action, not a mode)
    Every current connection is closed abruptly to both sides with SO_LINGER 0, so each peer gets an RST
    ("connection reset by peer"), as from a middlebox dropping its state or a peer host rebooting. A
    Unix-socket server side sees an EOF instead. The mode stays; later connections are proxied as usual.
    Connections left hanging by ``refuse_new(hang=True)`` are closed too.

``refuse_new(True)`` / ``refuse_new(True, hang=True)`` / ``refuse_new(False)``
    New connections are accepted and reset at once (the client gets a reset, or an EOF, during startup,
    not ECONNREFUSED: the port stays ours), or, with ``hang``, accepted and left silent (the handshake
    completes and nothing ever answers: a hung server, or a partition met by a new connection) until
    ``reset()`` or ``close()``. Current connections are not touched. ``refuse_new(False)`` proxies new
    connections again (hanging ones stay hanging).

``close()`` resets every connection, stops listening and ends the thread.

Counters: ``accepted`` (connections accepted, refused ones included), ``refused``, ``bytes_to_server`` and
``bytes_to_client`` (bytes written on to the other side, over all connections), and the same byte
counters per connection. To find the proxy connection of a server session: its
``pg_stat_activity.client_port`` is the connection's ``upstream_port`` (TCP targets only); a client's
own local port is its ``client_port``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, TypeVar

from psycopg.conninfo import conninfo_to_dict, make_conninfo

Direction = Literal["to_server", "to_client"]
DIRECTIONS: tuple[Direction, Direction] = ("to_server", "to_client")
CHUNK = 65536
# Read ahead at most this much per direction before waiting for the other side to take it (back-pressure).
MAX_QUEUED = 1 << 20
CONTROL_TIMEOUT = 10.0  # seconds a control call waits for the proxy thread

T = TypeVar("T")


@dataclass(frozen=True)
class Mode:
    """What a connection does with its bytes: which directions are held, and the delay on the others."""

    name: str
    hold_to_server: bool = False
    hold_to_client: bool = False
    delay: float = 0.0

    def holds(self, direction: Direction) -> bool:
        return self.hold_to_server if direction == "to_server" else self.hold_to_client


FORWARD = Mode("forward")


class _Modes:
    """The mode switches shared by the proxy (all connections) and by one connection."""

    def _apply(self, mode: Mode) -> None:
        raise NotImplementedError

    def forward(self) -> None:
        """Forward both ways at once (a healthy network); held and delayed bytes go on, in order."""
        self._apply(FORWARD)

    def blackhole(self) -> None:
        """Stop both directions silently, closing nothing (a partition); ``forward()`` resumes it all."""
        self._apply(Mode("blackhole", hold_to_server=True, hold_to_client=True))

    def one_way(self, stopped: Direction) -> None:
        """Stop the ``stopped`` direction only; the other keeps flowing."""
        if stopped not in DIRECTIONS:
            raise ValueError(f"one_way() takes 'to_server' or 'to_client', not {stopped!r}")
        self._apply(Mode(f"one_way({stopped})", hold_to_server=stopped == "to_server",
                         hold_to_client=stopped == "to_client"))

    def latency(self, seconds: float) -> None:
        """Deliver every chunk ``seconds`` after it arrived, both ways, in order."""
        if seconds < 0:
            raise ValueError("latency cannot be negative")
        self._apply(Mode(f"latency({seconds})", delay=seconds))


def _abort(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets an RST, not a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Pipe:
    """One direction of a connection: bytes read from ``src`` wait in ``queue`` until written to ``dst``."""

    def __init__(self, direction: Direction, src: socket.socket, dst: socket.socket) -> None:
        self.direction = direction
        self.src, self.dst = src, dst
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()  # (arrival, data|EOF)
        self.queued = 0
        self.src_eof = False  # the source sent its FIN (queued as None)
        self.shut = False  # that FIN was passed on
        self.blocked = False  # the destination took only part of what was due: wait until it is writable
        self.forwarded = 0


class Connection(_Modes):
    """One proxied client connection. Its mode starts as the proxy's and changes with either's switches."""

    def __init__(self, proxy: NetProxy, number: int, client: socket.socket, upstream: socket.socket,
                 mode: Mode) -> None:
        self.proxy = proxy
        self.number = number  # 1 for the first connection the proxy accepted, and so on
        self.mode = mode
        self.closed = False
        self.client, self.upstream = client, upstream
        self.client_port: int | None = _port(client.getpeername())
        self.upstream_port: int | None = None  # set once connected, TCP targets only
        self.connecting = True
        self.pipes: dict[Direction, _Pipe] = {
            "to_server": _Pipe("to_server", client, upstream),
            "to_client": _Pipe("to_client", upstream, client),
        }
        self._events: dict[socket.socket, int] = {client: 0, upstream: 0}

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode.name
        return f"<Connection #{self.number} client_port={self.client_port} {state}>"

    @property
    def bytes_to_server(self) -> int:
        return self.pipes["to_server"].forwarded

    @property
    def bytes_to_client(self) -> int:
        return self.pipes["to_client"].forwarded

    def _apply(self, mode: Mode) -> None:
        def set_mode() -> None:
            self.mode = mode

        self.proxy._call(set_mode)

    def reset(self) -> None:
        """Close this connection abruptly: an RST to both sides."""
        self.proxy._call(self._abort)

    # --- the proxy thread only, from here on

    def _abort(self) -> None:
        if not self.closed:
            self._close(_abort)

    def _close(self, closer: Callable[[socket.socket], None]) -> None:
        self.closed = True
        self.proxy._forget(self)  # first: a peer that sees the close finds the connection gone
        for sock in (self.client, self.upstream):
            if self._events[sock]:
                self.proxy._sel.unregister(sock)
                self._events[sock] = 0
            closer(sock)

    def _connected(self) -> None:
        err = self.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._abort()  # the target refused: the client gets an RST
            return
        self.connecting = False
        if self.upstream.family != socket.AF_UNIX:
            self.upstream_port = _port(self.upstream.getsockname())

    def _read(self, pipe: _Pipe) -> None:
        try:
            data = pipe.src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort()  # a reset from one side is passed on as a reset to the other
            return
        now = time.monotonic()
        if data:
            pipe.queue.append((now, data))
            pipe.queued += len(data)
        else:
            pipe.src_eof = True
            pipe.queue.append((now, None))

    def _flush(self, pipe: _Pipe, now: float) -> None:
        """Write on what is due; the EOF once everything before it went."""
        while pipe.queue and not self.closed:
            arrived, data = pipe.queue[0]
            if arrived + self.mode.delay > now:
                break
            if data is None:
                pipe.queue.popleft()
                pipe.shut = True
                with contextlib.suppress(OSError):
                    pipe.dst.shutdown(socket.SHUT_WR)
                break
            try:
                sent = pipe.dst.send(data)
            except (BlockingIOError, InterruptedError):
                pipe.blocked = True
                return
            except OSError:
                self._abort()
                return
            pipe.forwarded += sent
            pipe.queued -= sent
            self.proxy._counted(pipe.direction, sent)
            if sent < len(data):
                pipe.queue[0] = (arrived, data[sent:])
                pipe.blocked = True
                return
            pipe.queue.popleft()
        pipe.blocked = False

    def _pump(self, now: float) -> float | None:
        """Flush what may go, set what to wait for; returns when the next delayed chunk is due."""
        if not self.connecting:
            for pipe in self.pipes.values():
                if not self.mode.holds(pipe.direction):
                    self._flush(pipe, now)
        if self.closed:
            return None
        if all(p.shut for p in self.pipes.values()):
            self._close(socket.socket.close)  # both sides said goodbye: close normally
            return None
        due: float | None = None
        wanted = {self.client: 0, self.upstream: 0}
        for pipe in self.pipes.values():
            if self.mode.holds(pipe.direction):
                continue
            reading = not pipe.src_eof and pipe.queued < MAX_QUEUED
            if reading and not (pipe.src is self.upstream and self.connecting):
                wanted[pipe.src] |= selectors.EVENT_READ
            if self.connecting:
                continue
            if pipe.blocked:
                wanted[pipe.dst] |= selectors.EVENT_WRITE
            elif pipe.queue:
                head = pipe.queue[0][0] + self.mode.delay
                due = head if due is None else min(due, head)
        if self.connecting:
            wanted[self.upstream] = selectors.EVENT_WRITE
        for sock, events in wanted.items():
            if events != self._events[sock]:
                if not self._events[sock]:
                    self.proxy._sel.register(sock, events, self)
                elif not events:
                    self.proxy._sel.unregister(sock)
                else:
                    self.proxy._sel.modify(sock, events, self)
                self._events[sock] = events
        return due

    def _ready(self, sock: socket.socket, events: int) -> None:
        if sock is self.upstream and self.connecting:
            self._connected()
            return
        if events & selectors.EVENT_READ:
            self._read(self.pipes["to_server" if sock is self.client else "to_client"])
        # Writable: the next _pump() flushes.


def _port(address: object) -> int | None:
    return int(address[1]) if isinstance(address, tuple) else None


class NetProxy(_Modes):
    """A loopback proxy to ``target_host:target_port`` (a Unix-socket directory as host works as in libpq),
    listening on 127.0.0.1:``port``. See the module's docstring for the modes."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host, self.target_port = target_host, target_port
        self._family: socket.AddressFamily
        self._address: str | tuple[object, ...]
        if target_host.startswith("/"):
            self._family, self._address = socket.AF_UNIX, os.path.join(target_host, f".s.PGSQL.{target_port}")
        else:
            family, _, _, _, address = socket.getaddrinfo(target_host, target_port, type=socket.SOCK_STREAM)[0]
            self._family, self._address = family, address
        self.accepted = 0
        self.refused = 0
        self._forwarded: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        self._mode = FORWARD
        self._refusing = False
        self._hang = False
        self._connections: list[Connection] = []
        self._hanging: list[socket.socket] = []
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self._stopping = False

        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=f"netproxy:{self.port}", daemon=True)
        self._thread.start()

    @classmethod
    def for_dsn(cls, dsn: str) -> NetProxy:
        """A proxy to the server a libpq DSN names (its host and port)."""
        params = conninfo_to_dict(dsn)
        host = str(params.get("hostaddr") or params.get("host") or "")
        if not host:
            raise ValueError("the DSN names no host: give NetProxy(host, port) the server's address")
        return cls(host, int(str(params.get("port") or 5432)))

    def dsn_through(self, dsn: str) -> str:
        """The same DSN, going through this proxy."""
        params = conninfo_to_dict(dsn)
        params.pop("hostaddr", None)
        params.update(host="127.0.0.1", port=str(self.port))
        return make_conninfo("", **params)

    def __repr__(self) -> str:
        return f"<NetProxy 127.0.0.1:{self.port} -> {self._address!r} {self._mode.name}>"

    def __enter__(self) -> NetProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- the tests' side

    @property
    def mode(self) -> Mode:
        """The mode of the proxy: what new connections start with."""
        return self._mode

    @property
    def connections(self) -> list[Connection]:
        """The open connections, oldest first (a snapshot)."""
        with self._lock:
            return list(self._connections)

    @property
    def bytes_to_server(self) -> int:
        return self._forwarded["to_server"]

    @property
    def bytes_to_client(self) -> int:
        return self._forwarded["to_client"]

    def connection(self, *, client_port: int | None = None, upstream_port: int | None = None) -> Connection:
        """The open connection with this client port, or this upstream port (the server's
        ``pg_stat_activity.client_port`` / ``inet_client_port()`` of the session)."""
        for conn in self.connections:
            if (client_port is not None and conn.client_port == client_port) or (
                    upstream_port is not None and conn.upstream_port == upstream_port):
                return conn
        raise LookupError(f"no open connection with client_port={client_port} upstream_port={upstream_port}")

    def _apply(self, mode: Mode) -> None:
        def set_mode() -> None:
            self._mode = mode
            for conn in self._connections:
                conn.mode = mode

        self._call(set_mode)

    def reset(self) -> None:
        """Close every current connection (and hanging one) abruptly: an RST to both sides."""
        self._call(self._reset_all)

    def refuse_new(self, refuse: bool = True, *, hang: bool = False) -> None:
        """Reset each new connection as soon as it is accepted, or with ``hang`` leave it silent;
        ``refuse_new(False)`` proxies new connections again."""
        def set_refusing() -> None:
            self._refusing, self._hang = refuse, hang

        self._call(set_refusing)

    def close(self) -> None:
        """Reset every connection, stop listening and end the proxy's thread. Idempotent."""
        def stop() -> None:
            self._stopping = True  # the loop's end resets every connection and closes the sockets

        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.append(stop)
        self._wake()
        self._thread.join(CONTROL_TIMEOUT)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the proxy's thread and wait for it: when a control call returns, it is in effect."""
        if threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        outcome: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                outcome.append(fn())
            except BaseException as exc:
                failure.append(exc)
            finally:
                done.set()

        with self._lock:
            if self._closed or self._stopping:
                raise RuntimeError("the proxy is closed")
            self._commands.append(run)
        self._wake()
        deadline = time.monotonic() + CONTROL_TIMEOUT
        while not done.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy's thread is gone or stuck")
        if failure:
            raise failure[0]
        return outcome[0]

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a wake-up is already pending, or the proxy is closing
            self._wake_w.send(b"\0")

    # --- the proxy thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                due = [d for c in list(self._connections) if (d := c._pump(now)) is not None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                for key, events in self._sel.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._run_commands()
                    elif isinstance(key.data, Connection) and not key.data.closed:
                        key.data._ready(key.fileobj, events)  # type: ignore[arg-type]
        finally:
            with self._lock:
                self._stopping = True
                commands, self._commands = list(self._commands), collections.deque()
            self._reset_all()
            for command in commands:  # answer any caller still waiting
                command()
            self._sel.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _run_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            command()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the client gave up before we accepted it
                continue
            except OSError:  # out of descriptors, say: try again on the next readiness
                return
            self.accepted += 1
            if self._refusing:
                self.refused += 1
                if self._hang:
                    self._hanging.append(client)
                else:
                    _abort(client)
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = socket.socket(self._family, socket.SOCK_STREAM)
            upstream.setblocking(False)
            if self._family != socket.AF_UNIX:
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn = Connection(self, self.accepted, client, upstream, self._mode)
            except OSError:  # the client is already gone
                _abort(client)
                upstream.close()
                continue
            with self._lock:
                self._connections.append(conn)
            err = upstream.connect_ex(self._address)
            if err == 0:
                conn._connected()
            elif err != errno.EINPROGRESS:
                conn._abort()  # nothing listens there (or a full Unix backlog): the client gets an RST

    def _forget(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)

    def _counted(self, direction: Direction, n: int) -> None:
        self._forwarded[direction] += n

    def _reset_all(self) -> None:
        for conn in list(self._connections):
            conn._abort()
        for sock in self._hanging:
            _abort(sock)
        self._hanging.clear()
