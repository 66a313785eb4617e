"""hvcomm's own TCP connections between ranks, for the ring's large messages
(``HVCOMM_RING_TRANSPORT=tcp``).

Open MPI's TCP transport reads each fragment into a buffer of its own and then copies it to
the destination (``opal_convertor_unpack``), and moves data only while a rank polls it. Here
each direction of each (peer, tag) pair has its own connection and a thread at each end that
blocks in the kernel: the sender's ``sendall`` reads the array in place and the receiver's
``recv_into`` writes straight into the buffer posted (the ring's inbox in its reduce-scatter,
the array itself in its allgather), as soon as the bytes arrive.

A message on a link is a plain run of bytes: both ends post the same sizes in the same order,
as MPI's matching by (source, tag) requires of the ring anyway. The connections of a
communicator are made on first use: :func:`links_of` is collective the first time (one
allgather of each rank's listening addresses, the first rank's random token), and so is
:meth:`Links.ring` on each tag's first ring; a connection is accepted only with the token and
the rank it is meant for. The links close when the communicator is freed (after the rings
under way). A failed link fails every link of its communicator, so the error goes around the
ring and every rank raises; the communicator's links are refused after that.

Addresses: each interface's IPv4 address, loopback's last (``HVCOMM_SOCKET_IFNAME``,
comma-separated interface names, restricts them, as ``GLOO_SOCKET_IFNAME`` does for gloo); the
first that answers with the right token is used.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import secrets
import socket
import struct
import threading
from typing import Callable, Dict, List, Optional, Tuple

from .errors import HvcommError, raise_together

CONNECT_TIMEOUT_S = 10.0
_HELLO = struct.Struct("!16siii")  # token, sender's rank, receiver's rank, tag
_ACK = b"\x01"
_SIOCGIFADDR = 0x8915
_KEYVAL = None
_ATTACH = threading.Lock()  # a link's connection is set once


class Transfer:
    """One send or receive on a link: the request the ring's schedule yields
    (``Test``/``Wait``, as an MPI request)."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()

    def Test(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error
        return self._done.is_set()

    def Wait(self) -> None:
        self._done.wait()
        self.Test()


def _interface_addresses() -> List[str]:
    """The IPv4 addresses of this host's interfaces, loopback last (HVCOMM_SOCKET_IFNAME:
    only those interfaces)."""
    wanted = [n for n in os.environ.get("HVCOMM_SOCKET_IFNAME", "").split(",") if n]
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            if wanted and name not in wanted:
                continue
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    if wanted and not found:
        raise HvcommError(f"HVCOMM_SOCKET_IFNAME={os.environ['HVCOMM_SOCKET_IFNAME']!r}: no "
                          f"IPv4 address on these interfaces; this host has "
                          f"{[n for _, n in socket.if_nameindex()]}")
    found.sort(key=lambda a: a.startswith("127."))
    return found or ["127.0.0.1"]


def _receive_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


class _Link:
    """One direction of one (peer, tag): a queue of transfers served by one thread. The first
    error (of the connection, or :meth:`shutdown`) fails every transfer after it and calls
    ``on_error``."""

    def __init__(self, name: str, sending: bool, on_error: Callable[[], None]) -> None:
        self.name, self._sending, self._on_error = name, sending, on_error
        self._sock: Optional[socket.socket] = None
        self._ready = threading.Event()
        self._queue: "queue.SimpleQueue[Tuple[Optional[memoryview], Transfer]]" = \
            queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        threading.Thread(target=self._serve, name=f"hvcomm-tcp {name}", daemon=True).start()

    def attach(self, sock: Optional[socket.socket], error: Optional[str] = None) -> None:
        """The connection (once: a later one is closed), or why there is none."""
        with _ATTACH:
            if self._ready.is_set():
                if sock is not None:
                    sock.close()
                return
            if sock is not None:
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._error = None if error is None else HvcommError(f"TCP link {self.name}: {error}")
            self._ready.set()

    def wait(self, timeout: float) -> Optional[str]:
        """Wait up to ``timeout`` s for the connection: None once made, else what is wrong."""
        if not self._ready.wait(timeout):
            return f"TCP link {self.name}: no connection within {timeout:.0f} s"
        return None if self._error is None else str(self._error)

    def post(self, view: Optional[memoryview]) -> Transfer:
        """Queue a transfer (None: nothing to move, done once the ones before it are)."""
        transfer = Transfer()
        self._queue.put((view, transfer))
        return transfer

    def shutdown(self, why: str) -> None:
        """Fail this link: a transfer under way returns, the later ones fail at once."""
        self.attach(None, why)  # (if it never connected)
        if self._error is None:
            self._error = HvcommError(f"TCP link {self.name}: {why}")
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """End the thread after the transfers queued."""
        self._queue.put((None, None))
        self.attach(None, "closed")  # (if it never connected: the thread must not wait on)

    def _serve(self) -> None:
        self._ready.wait()
        while True:
            view, transfer = self._queue.get()
            if transfer is None:
                break
            if self._error is None and view is not None:
                try:
                    if self._sending:
                        self._sock.sendall(view)
                    else:
                        _receive_exactly(self._sock, view)
                except BaseException as err:  # noqa: BLE001 - failed: reported to its waiter
                    self._error = HvcommError(f"TCP link {self.name}: {err}")
                    self._on_error()
            transfer.finish(self._error if view is not None else None)
        if self._sock is not None:
            self._sock.close()


class Links:
    """The TCP links of one communicator (see the module's docstring)."""

    def __init__(self, comm) -> None:
        self.rank = comm.Get_rank()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("0.0.0.0", 0))
            self._listener.listen(64)
            addresses, error = _interface_addresses(), None
        except (OSError, HvcommError) as err:
            addresses, error = [], str(err)
        try:
            raise_together(comm, error, "TCP links (HVCOMM_RING_TRANSPORT=tcp)")
        except HvcommError:
            self._listener.close()
            raise
        token = secrets.token_bytes(16) if self.rank == 0 else None
        self._token = comm.bcast(token, root=0)
        self._where = comm.allgather((addresses, self._listener.getsockname()[1]))
        self._lock = threading.Lock()
        self._out: Dict[Tuple[int, int], _Link] = {}
        self._in: Dict[Tuple[int, int], _Link] = {}
        self._broken: Optional[str] = None  # why these links can no longer be used
        self._rings = 0  # rings under way
        self._freed = False  # the communicator was freed: close once no ring is under way
        threading.Thread(target=self._accept, name="hvcomm-tcp accept", daemon=True).start()

    @contextlib.contextmanager
    def ring(self, comm, tag: int):
        """(send, recv) for one ring on ``tag``, over the links to the next rank and from the
        previous one, made on the tag's first ring (collective then; HvcommError on every rank
        if any rank cannot make its links). If the ring raises (or is abandoned), every link
        of the communicator fails, so that its peers raise too, not wait, and the ring's
        buffers are no longer written when it ends."""
        self._open_ring(comm, tag)
        self._rings += 1
        try:
            yield self._send, self._recv
        except BaseException:
            self._fail("a ring on this communicator failed")
            raise
        finally:
            self._rings -= 1
            if self._freed and not self._rings:
                self._close()

    def _open_ring(self, comm, tag: int) -> None:
        if self._broken:
            raise HvcommError(f"TCP links of this communicator: {self._broken}; use a new "
                              "communicator")
        p = comm.Get_size()
        nxt, prv = (self.rank + 1) % p, (self.rank - 1) % p
        if (nxt, tag) in self._out:  # (every rank made its links in the same call)
            return
        comm.Barrier()  # all here: each wait below is bounded by the connection attempts
        out = self._out[(nxt, tag)] = self._link(f"{self.rank}->{nxt} tag {tag}", True)
        self._connect(out, nxt, tag)
        inbound = self._inbound(prv, tag)
        # the previous rank tries each of this rank's addresses: a connection, then the answer
        bound = 2 * CONNECT_TIMEOUT_S * len(self._where[self.rank][0]) + 5
        error = out.wait(0) or (inbound.wait(bound) if inbound else self._broken)
        try:
            raise_together(comm, error, "ring over TCP links (HVCOMM_RING_TRANSPORT=tcp)")
        except HvcommError as err:
            self._fail(f"could not be made ({err})")
            raise

    def _send(self, data, dest: int, tag: int) -> Transfer:
        return self._out[(dest, tag)].post(memoryview(data).cast("B"))

    def _recv(self, data, source: int, tag: int) -> Transfer:
        return self._in[(source, tag)].post(memoryview(data).cast("B"))

    def _link(self, name: str, sending: bool) -> _Link:
        return _Link(name, sending, on_error=lambda: self._fail("a link failed", drain=False))

    def _inbound(self, source: int, tag: int) -> Optional[_Link]:
        with self._lock:
            if self._broken:
                return None
            link = self._in.get((source, tag))
            if link is None:
                link = self._in[(source, tag)] = self._link(f"{source}->{self.rank} tag {tag}",
                                                            False)
            return link

    def _fail(self, why: str, drain: bool = True) -> None:
        """Fail every link (their peers then fail theirs, around the ring); ``drain``: wait
        until no link's thread writes into a buffer any more (not from one of them)."""
        with self._lock:
            first, self._broken = not self._broken, self._broken or why
            links = list(self._out.values()) + list(self._in.values())
        for link in links if first else ():
            link.shutdown(why)
        for link in links if drain else ():
            link.post(None).Wait()  # (FIFO: every transfer before it has finished)

    def _connect(self, link: _Link, dest: int, tag: int) -> None:
        addresses, port = self._where[dest]
        errors = []
        for address in addresses:
            sock = None
            try:
                sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
                sock.sendall(_HELLO.pack(self._token, self.rank, dest, tag))
                if sock.recv(1) == _ACK:
                    link.attach(sock)
                    return
                errors.append(f"{address}: not rank {dest} of this communicator")
            except OSError as err:
                errors.append(f"{address}: {err}")
            if sock is not None:
                sock.close()
        link.attach(None, f"cannot reach rank {dest} at port {port} ({'; '.join(errors)}); set "
                          "HVCOMM_SOCKET_IFNAME to the interface the ranks share, or "
                          "HVCOMM_RING_TRANSPORT=mpi")

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                hello = bytearray(_HELLO.size)
                _receive_exactly(sock, memoryview(hello))
                token, source, dest, tag = _HELLO.unpack(hello)
                link = self._inbound(source, tag)
                if token != self._token or dest != self.rank or link is None:
                    sock.close()  # another job's, a rank whose port is ours in another network
                    continue      # namespace, or links already failed
                sock.sendall(_ACK)
                link.attach(sock)
            except OSError:
                sock.close()

    def free(self) -> None:
        """The communicator was freed: close the links once no ring is under way."""
        self._freed = True
        if not self._rings:
            self._close()

    def _close(self) -> None:
        with self._lock:
            links = list(self._out.values()) + list(self._in.values())
            self._out, self._in, self._broken = {}, {}, "the communicator was freed"
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone
        except OSError:                                # does not, on Linux)
            pass
        self._listener.close()
        for link in links:
            link.close()


def links_of(comm) -> Links:
    """The TCP links of ``comm`` (collective on first use; closed when ``comm`` is freed)."""
    global _KEYVAL
    from mpi4py import MPI
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda _c, _k, links: links.free())
    links = comm.Get_attr(_KEYVAL)
    if links is None:
        links = Links(comm)
        comm.Set_attr(_KEYVAL, links)
    return links

