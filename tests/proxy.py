"""A controllable TCP proxy on 127.0.0.1 that injects network faults between a process and Redis.

Tests put a :class:`FaultProxy` between the processes they watch (Celery workers, redis-py clients)
and a real redis-server, hand those processes ``proxy.url_for(db)`` instead of the server's URL,
and switch faults from the test thread while the processes run::

    with FaultProxy("127.0.0.1", server.port) as proxy:
        client = redis.Redis.from_url(proxy.url_for(0), socket_timeout=1)
        proxy.black_hole()   # packets vanish: reads block, then time out
        proxy.heal()         # connections from before the outage are dead, new ones work
        proxy.black_hole(); proxy.heal(cut=False)   # ... and stay silent: nobody tells the client
        proxy.latency(200)   # every chunk waits 200 ms in each direction
        proxy.reset()        # every connection is cut with a TCP RST, both sides

All forwarding runs in one background thread around a selector (no thread per connection), so many
connections cost nothing and :meth:`FaultProxy.stop` leaves no thread behind. The control methods
are synchronous: they hand a command to that thread and return once it has been carried out, so
after ``proxy.reset()`` returns every connection has already been cut. Errors in the background
thread are logged at debug level (logger ``tests.proxy``) and never raised there; a connection
that fails is cut, the proxy keeps running.

Modes are exclusive: :meth:`~FaultProxy.black_hole`, :meth:`~FaultProxy.latency` and
:meth:`~FaultProxy.heal` each replace the current mode; :meth:`~FaultProxy.reset` is a one-shot
action that keeps the mode. They apply to existing and new connections alike.

Black hole semantics
--------------------
``black_hole()`` models a network that silently drops every packet (a partition, a dead switch,
a firewall DROP rule). The proxy stops forwarding in both directions and stops reading from and
writing to every socket, without closing any: a peer's writes fill the kernel buffers and its reads
block until its own timeout fires, exactly as with a real outage (and unlike a closed connection,
which a client notices at once). The listening socket is not served either: new connections
complete their handshake in the kernel's accept backlog, so the client's ``connect()`` succeeds,
but they are neither accepted by the proxy nor connected to the target, and their first command
goes unanswered.

A real black hole loses packets rather than queueing them, so nothing is delivered late. TCP would
retransmit, and a real peer would see its connection either resume or time out; we model the common
outcome after a long outage, where the old connection is dead: when the black hole ends (``heal()``
or ``latency()``), every proxied connection that existed during it is cut abruptly (RST to both the
client and the target) and the bytes held back are dropped. Connections that waited in the accept
backlog are then accepted and forwarded normally, bytes they wrote included (their handshake is what
TCP would have retried until it got through), except those whose client has already closed or reset
them (detected with ``TCP_INFO`` on Linux), which are dropped without reaching the target, so that
a command the client gave up on is never executed late. Connections opened after the heal work
normally.

``heal(cut=False)`` ends a black hole without that RST: the connections from before stay black-holed
for good (never forwarded, never closed; the proxy closes them only when it stops), as after a
failover to another address, a rebooted NAT or firewall that forgot them, or a server that was
replaced: a client learns that such a connection is dead only from its own timeouts (socket
timeouts, health checks, TCP keepalive). New connections work.

Latency
-------
``latency(ms)`` delays every chunk read from either side by ``ms`` milliseconds before it is
written to the other side, in order per direction (a PING round trip therefore takes at least
``2 * ms``). Chunks already delayed keep their due time when the latency changes; ``heal()`` sends
them at once.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

__all__ = ["FaultProxy", "Mode", "ProxyStats"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
CHUNK = 65536  # bytes read per recv
HIGH_WATER = 4 * 1024 * 1024  # bytes queued in one direction before the proxy stops reading its source
BACKLOG = 1024  # listen backlog: where new connections wait during a black hole
CONTROL_TIMEOUT = 10.0  # seconds a control method waits for the proxy thread
_TCP_ESTABLISHED = 1  # tcpi_state in Linux's struct tcp_info
_RST_LINGER = struct.pack("ii", 1, 0)  # SO_LINGER (on, 0 s): close() sends RST instead of FIN


class Mode(str, enum.Enum):
    """What the proxy does with the bytes it reads."""

    FORWARD = "forward"
    BLACK_HOLE = "black_hole"
    LATENCY = "latency"


@dataclass(frozen=True)
class ProxyStats:
    """A snapshot of the proxy's counters."""

    accepted: int  # connections accepted and forwarded (or attempted) since start()
    open: int  # proxied connections not yet closed
    bytes_to_server: int  # bytes written to the target (client -> server)
    bytes_to_client: int  # bytes written to clients (server -> client)


def _rst_close(sock: socket.socket) -> None:
    """Close ``sock`` abruptly: the peer gets a TCP RST (its next read or write fails with ECONNRESET)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST_LINGER)
    with contextlib.suppress(OSError):
        sock.close()


def _client_gone(sock: socket.socket) -> bool:
    """Whether a connection that waited in the accept backlog was closed or reset by its client."""
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True
        tcp_info = getattr(socket, "TCP_INFO", None)
        if tcp_info is None:  # not Linux: cannot tell, forward it
            return False
        return bool(sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 1)[0] != _TCP_ESTABLISHED)
    except OSError:
        return True


class _Pipe:
    """One direction of a proxied connection: bytes read from ``src`` waiting to be written to ``dst``."""

    __slots__ = ("blocked", "chunks", "dst", "eof", "name", "queued", "shut", "src")

    def __init__(self, src: socket.socket, dst: socket.socket, name: Literal["up", "down"]) -> None:
        self.src = src
        self.dst = dst
        self.name = name  # "up": client -> server, "down": server -> client
        self.chunks: deque[tuple[float, memoryview]] = deque()  # (due time, bytes), oldest first
        self.queued = 0  # bytes in chunks
        self.eof = False  # src sent FIN
        self.shut = False  # dst was shut down for writing (the FIN was passed on)
        self.blocked = False  # the last send to dst would block: wait until it is writable

    def head_due(self, now: float) -> bool:
        return bool(self.chunks) and self.chunks[0][0] <= now


class _Conn:
    """One proxied connection: the accepted client socket and the socket to the target."""

    __slots__ = ("blackholed", "client", "connected", "dead", "down", "events", "id", "server", "up")

    def __init__(self, ident: int, client: socket.socket, server: socket.socket) -> None:
        self.id = ident
        self.client = client
        self.server = server
        self.connected = False  # the connect() to the target has completed
        self.blackholed = False  # it existed during a black hole: cut when the black hole ends
        self.dead = False  # it existed during a black hole that ended with heal(cut=False): silent for good
        self.up = _Pipe(client, server, "up")
        self.down = _Pipe(server, client, "down")
        self.events: dict[str, int] = {"client": 0, "server": 0}  # what each socket is registered for

    def sock(self, side: str) -> socket.socket:
        return self.client if side == "client" else self.server


class FaultProxy:
    """A TCP proxy from 127.0.0.1:``port`` to ``target_host:target_port`` that can drop, delay and cut traffic.

    Start it with :meth:`start` (or ``with FaultProxy(...) as proxy``), give clients :meth:`url_for`,
    and switch faults with :meth:`black_hole`, :meth:`latency`, :meth:`reset` and :meth:`heal` from
    any thread. See the module docstring for the exact semantics of each fault.
    """

    def __init__(self, target_host: str, target_port: int, listen_port: int | None = None) -> None:
        self.target_host = target_host
        self.target_port = int(target_port)
        self._listen_port = listen_port
        self._port: int | None = None
        self._mode = Mode.FORWARD
        self._delay = 0.0  # seconds, in Mode.LATENCY
        self._accepted = 0
        self._bytes_to_server = 0
        self._bytes_to_client = 0
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._listener: socket.socket | None = None
        self._listener_registered = False
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._running = False  # the proxy thread keeps looping while True
        self._serving = False  # the proxy thread takes commands (guarded by _lock)
        self._commands: deque[tuple[Callable[[], Any], threading.Event, list[Any]]] = deque()
        self._lock = threading.Lock()  # guards _commands and the start/stop state

    # --- public API ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on (known once started)."""
        if self._port is None:
            raise RuntimeError("FaultProxy is not started")
        return self._port

    @property
    def mode(self) -> Mode:
        """The current fault mode."""
        return self._mode

    @property
    def accepted(self) -> int:
        """Connections accepted since start(): each one forwarded, or cut if the target refuses it.

        Not counted: connections that waited in the backlog during a black hole and whose client had
        left by the heal (dropped without reaching the target).
        """
        return self._accepted

    @property
    def open_connections(self) -> int:
        """Proxied connections currently open (connections still waiting in the accept backlog not included)."""
        return len(self._conns)

    @property
    def bytes_to_server(self) -> int:
        """Bytes forwarded from clients to the target."""
        return self._bytes_to_server

    @property
    def bytes_to_client(self) -> int:
        """Bytes forwarded from the target to clients."""
        return self._bytes_to_client

    def stats(self) -> ProxyStats:
        """A snapshot of all counters."""
        return ProxyStats(self._accepted, len(self._conns), self._bytes_to_server, self._bytes_to_client)

    def url_for(self, db: int = 0) -> str:
        """``redis://127.0.0.1:<port>/<db>``: a Redis URL that goes through the proxy."""
        return f"redis://{HOST}:{self.port}/{db}"

    def start(self) -> Self:
        """Bind 127.0.0.1 on ``listen_port`` (a free port if None) and start forwarding in a background thread."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("FaultProxy already started")
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((HOST, self._listen_port or 0))
                listener.listen(BACKLOG)
                listener.setblocking(False)
                wake_r, wake_w = socket.socketpair()
            except BaseException:
                listener.close()
                raise
            wake_r.setblocking(False)
            wake_w.setblocking(False)
            self._listener, self._wake_r, self._wake_w = listener, wake_r, wake_w
            self._port = int(listener.getsockname()[1])
            self._selector = selectors.DefaultSelector()
            self._selector.register(wake_r, selectors.EVENT_READ, None)
            self._running = self._serving = True
            self._thread = threading.Thread(target=self._run, name=f"FaultProxy-{self._port}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Cut every connection (RST), close the listening socket and end the background thread.

        Idempotent. Connections still waiting in the accept backlog are reset by the kernel when
        the listening socket closes.
        """
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        try:
            self._call(self._do_stop)
        except RuntimeError:
            log.debug("FaultProxy-%s: stop command not acknowledged", self._port, exc_info=True)
        thread.join(CONTROL_TIMEOUT)
        if thread.is_alive():  # cannot happen unless the thread is wedged: it is a daemon, leave it
            log.debug("FaultProxy-%s: proxy thread did not end", self._port)
            return
        with self._lock:
            for sock in (self._wake_r, self._wake_w):
                if sock is not None:
                    sock.close()
            self._wake_r = self._wake_w = None
            self._thread = None  # start() may be called again (same port: FaultProxy(..., listen_port=p.port))

    def black_hole(self) -> None:
        """Drop all traffic without closing anything; connections from before are cut when it ends."""
        self._call(self._do_black_hole)

    def latency(self, ms: float) -> None:
        """Delay every chunk by ``ms`` milliseconds in each direction (ends a black hole; 0 means heal)."""
        if ms < 0:
            raise ValueError("latency must be >= 0 ms")
        self._call(lambda: self._do_set_mode(Mode.LATENCY if ms else Mode.FORWARD, ms / 1000.0))

    def heal(self, cut: bool = True) -> None:
        """Plain forwarding again: ends a black hole and latency. The connections a black hole held
        are cut (RST), or with ``cut=False`` stay black-holed for good (only new connections work)."""
        self._call(lambda: self._do_set_mode(Mode.FORWARD, 0.0, cut))

    @property
    def dead_connections(self) -> int:
        """Connections left black-holed for good by ``heal(cut=False)`` (not yet closed by stop or reset)."""
        return sum(1 for conn in self._conns.values() if conn.dead)

    def reset(self) -> None:
        """Cut every current connection with a TCP RST on both sides; new connections work. Keeps the mode."""
        self._call(self._do_reset)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self._port if self._port is not None else "unstarted"
        return (f"<FaultProxy {HOST}:{where} -> {self.target_host}:{self.target_port} {self._mode.value} "
                f"open={len(self._conns)}>")

    # --- control: commands run in the proxy thread ---------------------------------------------

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the proxy thread and wait for it; run it here if the proxy is not running."""
        if threading.current_thread() is self._thread:  # not expected, but never deadlock
            return fn()
        done = threading.Event()
        result: list[Any] = []
        with self._lock:
            serving = self._serving
            if serving:
                self._commands.append((fn, done, result))
            else:  # not started, or stopped: no sockets, only the mode changes (under the lock: no race)
                return fn()
        self._wake()
        if not done.wait(CONTROL_TIMEOUT):
            raise RuntimeError(f"FaultProxy-{self._port}: the proxy thread did not answer")
        if result and isinstance(result[0], BaseException):
            raise result[0]
        return result[0] if result else None

    def _wake(self) -> None:
        wake_w = self._wake_w
        if wake_w is not None:
            with contextlib.suppress(OSError):  # BlockingIOError: a wake-up byte is already pending
                wake_w.send(b"\0")

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, done, result = self._commands.popleft()
            try:
                result.append(fn())
            except BaseException as exc:  # handed to the caller, raised in its thread
                result.append(exc)
            finally:
                done.set()

    def _do_stop(self) -> None:
        self._running = False

    def _do_black_hole(self) -> None:
        self._mode = Mode.BLACK_HOLE
        for conn in self._conns.values():
            conn.blackholed = True

    def _do_set_mode(self, mode: Mode, delay: float, cut: bool = True) -> None:
        leaving_black_hole = self._mode is Mode.BLACK_HOLE
        self._mode, self._delay = mode, delay
        if leaving_black_hole:
            for conn in [c for c in self._conns.values() if c.blackholed and not c.dead]:
                if cut:
                    self._abort(conn, "black hole ended")
                else:  # silent for good: no byte forwarded, nothing closed, its queued bytes dropped
                    conn.dead = True
                    for pipe in (conn.up, conn.down):
                        pipe.chunks.clear()
                        pipe.queued = 0
            self._accept_backlog(after_black_hole=True)
        if mode is Mode.FORWARD:  # delayed chunks are due now
            for conn in self._conns.values():
                for pipe in (conn.up, conn.down):
                    if pipe.chunks:
                        pipe.chunks = deque((0.0, data) for _, data in pipe.chunks)

    def _do_reset(self) -> None:
        for conn in list(self._conns.values()):
            self._abort(conn, "reset")
        if self._mode is Mode.BLACK_HOLE and self._listener is not None:  # and those waiting in the backlog
            while True:
                try:
                    sock, _ = self._listener.accept()
                except OSError:
                    break
                _rst_close(sock)

    # --- the proxy thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._running:
                try:
                    self._iterate()
                except Exception:  # never raise in the background: log, and keep going
                    log.debug("FaultProxy-%s: error in the proxy loop", self._port, exc_info=True)
                    time.sleep(0.01)
        finally:
            self._shutdown()

    def _iterate(self) -> None:
        assert self._selector is not None
        self._run_commands()
        if not self._running:
            return
        now = time.monotonic()
        if self._mode is not Mode.BLACK_HOLE:
            for conn in list(self._conns.values()):
                if not conn.dead:
                    self._flush(conn, now)
        self._register_all()
        timeout = self._next_timeout(time.monotonic())
        for key, events in self._selector.select(timeout):
            if key.data is None:
                self._drain_wake()
            elif key.data == "listener":
                self._accept_backlog(after_black_hole=False)
            else:
                conn, side = key.data
                if conn.id in self._conns:
                    self._on_ready(conn, side, events)

    def _next_timeout(self, now: float) -> float | None:
        if self._mode is Mode.BLACK_HOLE:
            return None
        due = [pipe.chunks[0][0] for conn in self._conns.values() for pipe in (conn.up, conn.down)
               if pipe.chunks and not pipe.blocked]
        if not due:
            return None
        return max(0.0, min(due) - now)

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _register_all(self) -> None:
        assert self._selector is not None and self._listener is not None
        holding = self._mode is Mode.BLACK_HOLE
        if holding and self._listener_registered:  # new connections wait in the backlog
            self._selector.unregister(self._listener)
            self._listener_registered = False
        elif not holding and not self._listener_registered:
            self._selector.register(self._listener, selectors.EVENT_READ, "listener")
            self._listener_registered = True
        for conn in self._conns.values():
            for side in ("client", "server"):
                self._register(conn, side, 0 if holding or conn.dead else self._wanted(conn, side))

    def _wanted(self, conn: _Conn, side: str) -> int:
        if not conn.connected:
            return selectors.EVENT_WRITE if side == "server" else 0  # waiting for connect() to the target
        out, into = (conn.up, conn.down) if side == "client" else (conn.down, conn.up)
        events = 0
        if not out.eof and out.queued < HIGH_WATER:
            events |= selectors.EVENT_READ
        if into.blocked:
            events |= selectors.EVENT_WRITE
        return events

    def _register(self, conn: _Conn, side: str, events: int) -> None:
        assert self._selector is not None
        current = conn.events[side]
        if events == current:
            return
        sock = conn.sock(side)
        if current == 0:
            self._selector.register(sock, events, (conn, side))
        elif events == 0:
            self._selector.unregister(sock)
        else:
            self._selector.modify(sock, events, (conn, side))
        conn.events[side] = events

    def _unregister(self, conn: _Conn) -> None:
        assert self._selector is not None
        for side in ("client", "server"):
            if conn.events[side]:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(conn.sock(side))
                conn.events[side] = 0

    def _accept_backlog(self, after_black_hole: bool) -> None:
        """Accept every connection waiting in the backlog and connect each one to the target."""
        if self._listener is None:
            return
        for _ in range(BACKLOG):
            try:
                client, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. ECONNABORTED, EMFILE: log it, try again on the next event
                log.debug("FaultProxy-%s: accept failed: %s", self._port, exc)
                return
            if after_black_hole and _client_gone(client):
                log.debug("FaultProxy-%s: dropping a connection its client left during the black hole",
                          self._port)
                _rst_close(client)
                continue
            self._open(client)

    def _open(self, client: socket.socket) -> None:
        self._accepted += 1
        try:
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            log.debug("FaultProxy-%s: cannot set up a connection", self._port, exc_info=True)
            _rst_close(client)
            return
        conn = _Conn(self._next_id, client, server)
        self._next_id += 1
        self._conns[conn.id] = conn
        try:
            server.setblocking(False)
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = server.connect_ex((self.target_host, self.target_port))
        except OSError as exc:  # e.g. the target host does not resolve
            code = exc.errno or errno.EIO
        if code == 0:
            conn.connected = True
        elif code not in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY, errno.EINTR):
            self._abort(conn, f"connect to the target failed: {errno.errorcode.get(code, code)}")

    def _on_ready(self, conn: _Conn, side: str, events: int) -> None:
        try:
            if not conn.connected:
                code = conn.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:  # the target refused: the client sees its connection reset, much like a refusal
                    self._abort(conn, f"connect to the target failed: {errno.errorcode.get(code, code)}")
                    return
                conn.connected = True
                return
            out, into = (conn.up, conn.down) if side == "client" else (conn.down, conn.up)
            if events & selectors.EVENT_WRITE:
                into.blocked = False
            if events & selectors.EVENT_READ:
                self._read(conn, out)
            if conn.id in self._conns:
                self._flush(conn, time.monotonic())
        except OSError as exc:
            self._abort(conn, f"{side} socket error: {exc}")

    def _read(self, conn: _Conn, pipe: _Pipe) -> None:
        try:
            data = pipe.src.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            pipe.eof = True
            return
        due = time.monotonic() + self._delay if self._mode is Mode.LATENCY else 0.0
        pipe.chunks.append((due, memoryview(data)))
        pipe.queued += len(data)

    def _flush(self, conn: _Conn, now: float) -> None:
        """Write the due chunks of both directions; pass on FINs; close the connection when both are done."""
        try:
            for pipe in (conn.up, conn.down):
                self._flush_pipe(pipe, now)
        except OSError as exc:
            self._abort(conn, f"send failed: {exc}")
            return
        if conn.up.shut and conn.down.shut:
            self._close(conn)

    def _flush_pipe(self, pipe: _Pipe, now: float) -> None:
        while not pipe.blocked and pipe.head_due(now):
            due, data = pipe.chunks[0]
            try:
                sent = pipe.dst.send(data)
            except (BlockingIOError, InterruptedError):
                pipe.blocked = True
                return
            pipe.queued -= sent
            if pipe.name == "up":
                self._bytes_to_server += sent
            else:
                self._bytes_to_client += sent
            if sent < len(data):
                pipe.chunks[0] = (due, data[sent:])
                pipe.blocked = True
                return
            pipe.chunks.popleft()
        if pipe.eof and not pipe.chunks and not pipe.shut:
            with contextlib.suppress(OSError):  # ENOTCONN: the other side is already gone
                pipe.dst.shutdown(socket.SHUT_WR)
            pipe.shut = True

    def _close(self, conn: _Conn) -> None:
        """Both directions ended with a FIN: close both sockets normally."""
        self._unregister(conn)
        self._conns.pop(conn.id, None)
        for sock in (conn.client, conn.server):
            with contextlib.suppress(OSError):
                sock.close()

    def _abort(self, conn: _Conn, why: str) -> None:
        """Cut the connection: RST to the client and to the target, queued bytes dropped."""
        log.debug("FaultProxy-%s: cutting connection %d: %s", self._port, conn.id, why)
        self._unregister(conn)
        self._conns.pop(conn.id, None)
        _rst_close(conn.client)
        _rst_close(conn.server)

    def _shutdown(self) -> None:
        """End of the proxy thread: cut every connection and close the listener and the selector."""
        try:
            for conn in list(self._conns.values()):
                self._abort(conn, "proxy stopped")
            if self._listener is not None:
                with contextlib.suppress(OSError):
                    self._listener.close()
            if self._selector is not None:
                self._selector.close()
        except Exception:
            log.debug("FaultProxy-%s: error while shutting down", self._port, exc_info=True)
        finally:
            self._running = False
            self._conns.clear()
            self._listener = None
            self._listener_registered = False
            self._selector = None
            with self._lock:
                self._serving = False
                pending = list(self._commands)
                self._commands.clear()
            for _fn, done, result in pending:  # stop() raced with other commands: release their callers
                result.append(None)
                done.set()
