"""The same-host control channel of the one-sided transports (shm, cuda_ipc): LayerDone and
Commit over a Unix socket instead of unary gRPC calls.

On one host a unary gRPC call costs 0.3-1 ms, more once the channel has idled (as it has when
a prefill's last layer is done), while a round trip on a Unix socket costs 10-30 us. Commit is
on the time to first token, so a one-sided sender takes the socket when it can reach it.

    decode worker (receiver)                         prefill worker (sender), same host
    LocalControlServer(receiver).start()             connect(): the handshake names the path
      /dev/shm/pdserve-kvctl-<pid>-<instance>.sock     LocalControlClient.open(path, instance)
      one thread per connection:                        hello -> the receiver's instance id
        request -> receiver.layer_done / commit       a session takes one connection: its
        reply (errors as gRPC status names)             LayerDones pipelined, then its Commit

Messages are LocalControlRequest / LocalControlReply (kv_transfer.proto), one per
SOCK_SEQPACKET datagram; a connection's replies come in the order of its requests. The verbs
mean what the RPCs mean, and fail with the same status names (errors.status_name). Begin and
Abort stay on gRPC: neither is on the critical path, and Abort must reach the receiver from any
thread while a session's connection waits for a reply.

The commit runs on the connection's thread, never on the gRPC event loop, so a long check
delays only its own sender. A receiver serves at most MAX_CONNECTIONS connections at once (a
thread each); one more is refused with RESOURCE_EXHAUSTED in place of the hello's answer, and
that sender's session keeps its control on gRPC (one_sided.py). Where the socket cannot be
reached (no shared /dev/shm, a receiver without one), connect() logs why and the control stays
on gRPC. The socket file is 0600, like the shm pool: both workers run as one user. A file left
by a killed receiver is unlinked by the next server started on the host (connecting to it is
refused).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from kv_transfer import wire
from kv_transfer.errors import TransferError, TransportRefusedError, status_name
from kv_transfer.transports.shm import DEFAULT_DIR
from protos.pdserve.internal import kv_transfer_pb2 as pb

if TYPE_CHECKING:  # the receiver imports the sender's modules; this module is both sides'
    from kv_transfer.receiver import KVReceiver

log = logging.getLogger("pdserve.kv_transfer")

SOCKET_PREFIX = "pdserve-kvctl"
MAX_MESSAGE_BYTES = 1 << 16  # a Commit of 1,000 layers is ~5 KB
MAX_IDLE_CONNECTIONS = 8  # a sender keeps at most this many connections open between sessions
MAX_CONNECTIONS = 256  # a receiver serves at most this many at once, a thread each
REFUSE_WAIT_S = 1.0  # how long a refused connection's hello is waited for


class LocalControlServer:
    """Answers LayerDone and Commit for `receiver` on a Unix socket in `directory`."""

    def __init__(self, receiver: KVReceiver, directory: str = DEFAULT_DIR,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.receiver = receiver
        self.directory = directory
        self.max_connections = max_connections
        self.path = os.path.join(directory, f"{SOCKET_PREFIX}-{os.getpid()}-"
                                            f"{receiver.instance_id}.sock")
        self.num_connections = 0  # accepted so far
        self.num_refused = 0  # connections turned away: max_connections were open
        self.num_requests = 0  # answered, all connections together
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name="kv-local-control")

    def start(self) -> LocalControlServer:
        reap_stale_sockets(self.directory)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._thread.start()
        log.info("kv transfer control for same-host senders on %s", self.path)
        return self

    def close(self) -> None:
        """Stop accepting, drop every connection (their senders fail with UNAVAILABLE) and
        unlink the socket file."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes recv()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> LocalControlServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def handle(self, data: bytes) -> pb.LocalControlReply:
        """The reply to one request; a receiver's error becomes its gRPC status name."""
        try:
            request = pb.LocalControlRequest.FromString(data)
            verb = request.WhichOneof("verb")
            if verb == "layer_done":
                msg = request.layer_done
                remaining_s = self.receiver.layer_done(msg.lease_id, msg.layer, msg.crc32)
                return pb.LocalControlReply(layer_done=pb.LayerDoneResponse(
                    remaining_ms=wire.to_ms(remaining_s)))
            if verb == "commit":
                msg = request.commit
                result = self.receiver.commit(msg.lease_id, list(msg.layer_crc32))
                return pb.LocalControlReply(commit=wire.commit_to_proto(result))
            if verb == "hello":
                return pb.LocalControlReply(receiver_instance=self.receiver.instance_id)
            raise ValueError("empty LocalControlRequest")
        except Exception as e:
            name = "INVALID_ARGUMENT" if isinstance(e, DecodeError) else status_name(e)
            if name is None:
                log.exception("local control request failed", exc_info=e)
                name = "INTERNAL"
            return pb.LocalControlReply(error=pb.LocalControlError(code=name, message=str(e)))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # close(): the listener was shut down
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._connections) >= self.max_connections
                if full:
                    self.num_refused += 1
                else:
                    self._connections.add(conn)
                    self.num_connections += 1
            if full:  # answered on a thread of its own, which ends within REFUSE_WAIT_S
                threading.Thread(target=self._refuse, args=(conn,), daemon=True,
                                 name="kv-local-control-refuse").start()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="kv-local-control-conn").start()

    def _refuse(self, conn: socket.socket) -> None:
        """Answer a connection over the bound: its hello gets RESOURCE_EXHAUSTED, then it is
        closed (closed first, the sender's hello would fail to send, as if the receiver were
        gone)."""
        if self.num_refused == 1 or self.num_refused % 1000 == 0:
            log.warning("kv control socket: %d connections are open, the most it serves; "
                        "refused %d so far (their senders use gRPC)", self.max_connections,
                        self.num_refused)
        reply = pb.LocalControlReply(error=pb.LocalControlError(
            code="RESOURCE_EXHAUSTED", message=f"{self.max_connections} connections are "
                                               f"open, the most this receiver serves"))
        with contextlib.suppress(OSError):
            conn.settimeout(REFUSE_WAIT_S)
            if conn.recv(MAX_MESSAGE_BYTES):
                conn.send(reply.SerializeToString())
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """One sender connection: each request answered in turn until it closes."""
        try:
            while data := conn.recv(MAX_MESSAGE_BYTES):
                reply = self.handle(data)
                with self._lock:
                    self.num_requests += 1
                conn.send(reply.SerializeToString())
        except OSError:  # the sender died or closed mid-reply, or close()
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()


def reap_stale_sockets(directory: str = DEFAULT_DIR) -> list[str]:
    """Unlink control sockets that no process listens on any more; returns their paths."""
    reaped = []
    for path in glob.glob(os.path.join(directory, f"{SOCKET_PREFIX}-*.sock")):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                reaped.append(path)
        except OSError:
            pass  # gone already, another user's, or alive and busy
        finally:
            probe.close()
    if reaped:
        log.warning("removed %d kv control socket(s) left by dead processes: %s", len(reaped),
                    reaped)
    return reaped


class LocalChannel:
    """One connection to a receiver's socket. Requests may be pipelined: `reply()` returns
    the answers in request order. Used by one session thread at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.num_pending = 0  # requests sent and not yet answered
        self.is_broken = False  # a reply was lost or the peer went away: never reuse

    def send(self, request: pb.LocalControlRequest) -> None:
        data = request.SerializeToString()
        assert data, "an empty datagram reads as a closed connection: a request has a verb"
        try:
            self._sock.send(data)
        except OSError as e:
            raise self._broken(f"send failed: {e}") from None
        self.num_pending += 1

    def has_reply(self) -> bool:
        """Whether the oldest pending request's reply has arrived, or the connection has
        ended (reply() then says so). Never blocks."""
        if not self.num_pending:
            return False
        try:
            self._sock.settimeout(0)  # non-blocking: a peek that finds nothing raises
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def reply(self, expected: str, timeout_s: float) -> pb.LocalControlReply:
        """The oldest pending request's reply, whose result must be `expected`
        ("layer_done", "commit", "receiver_instance"); TransferError if it failed (with the
        status name the RPC would carry) or did not come within timeout_s."""
        assert self.num_pending, "no request is waiting for a reply"
        try:
            self._sock.settimeout(timeout_s)
            data = self._sock.recv(MAX_MESSAGE_BYTES)
        except TimeoutError:
            raise self._broken(f"no reply within {timeout_s:.3f}s",
                               "DEADLINE_EXCEEDED") from None
        except OSError as e:
            raise self._broken(f"receive failed: {e}") from None
        if not data:
            raise self._broken("the receiver closed the connection")
        self.num_pending -= 1
        reply = pb.LocalControlReply.FromString(data)
        result = reply.WhichOneof("result")
        if result == "error":
            raise TransferError(f"{reply.error.code}: {reply.error.message}", reply.error.code)
        if result != expected:
            raise self._broken(f"expected a {expected} reply, got {result}", "INTERNAL")
        return reply

    def close(self) -> None:
        self.is_broken = True
        self._sock.close()

    def _broken(self, why: str, code: str = "UNAVAILABLE") -> TransferError:
        self.close()
        return TransferError(f"{code}: local control socket: {why}", code)


class LocalControlClient:
    """A sender's connections to one receiver's socket (see the module docstring). A session
    takes one for its life and gives it back; thread-safe."""

    def __init__(self, path: str, receiver_instance: str, timeout_s: float) -> None:
        self.path = path
        self.receiver_instance = receiver_instance
        self._timeout_s = timeout_s  # connect and hello
        self._idle: list[LocalChannel] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, path: str, receiver_instance: str, timeout_s: float) -> LocalControlClient:
        """Connect once to check that `path` reaches the receiver `receiver_instance`; raises
        TransportRefusedError (with the reason) if it does not."""
        client = cls(path, receiver_instance, timeout_s)
        try:
            client.give_back(client.take())
        except TransferError as e:
            raise TransportRefusedError(f"local control socket {path}: {e}") from None
        return client

    def take(self) -> LocalChannel:
        """An idle connection, or a new one (TransferError UNAVAILABLE if it cannot open)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(self._timeout_s)
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise TransferError(f"UNAVAILABLE: cannot connect to {self.path}: {e}",
                                "UNAVAILABLE") from None
        channel = LocalChannel(sock)
        try:
            channel.send(pb.LocalControlRequest(hello=True))
            instance = channel.reply("receiver_instance", self._timeout_s).receiver_instance
        except TransferError:  # RESOURCE_EXHAUSTED: the receiver's connections are full
            channel.close()
            raise
        if instance != self.receiver_instance:
            channel.close()
            raise TransferError(f"FAILED_PRECONDITION: {self.path} is receiver {instance}, "
                                f"not {self.receiver_instance}", "FAILED_PRECONDITION")
        return channel

    def give_back(self, channel: LocalChannel) -> None:
        """Keep a connection for the next session if it is clean, else close it."""
        with self._lock:
            if (not self._closed and not channel.is_broken and not channel.num_pending
                    and len(self._idle) < MAX_IDLE_CONNECTIONS):
                self._idle.append(channel)
                return
        channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for channel in idle:
            channel.close()
