"""The sender's end of the same-host control socket (the receiver's end, and the protocol:
receiver/control_server.py): a one-sided session's Begin, LayerDone and Commit as
LocalControlRequest datagrams on the decode worker's Unix socket instead of unary gRPC calls.

    connect()                                    the handshake names the socket's path
      LocalControlClient.open(path, instance)    one connection, hello -> the receiver's
                                                 instance id: refused if another process's
    session: channel = client.take()             one connection per session: its Begin
               channel.send(request) ...           (where the receiver takes it), its
               channel.reply(expected, timeout)    LayerDones pipelined (replies in request
                                                   order), then its Commit
             client.give_back(channel)           kept for the next session if clean

A connection that fails is closed, never reused; a receiver whose connections are full answers
RESOURCE_EXHAUSTED, and that session keeps its control on gRPC (transports/one_sided.py).
"""

from __future__ import annotations

import socket
import threading

from kv_transfer.errors import TransferError, TransportRefusedError
from kv_transfer.wire import MAX_CONTROL_MESSAGE_BYTES
from protos.pdserve.internal import kv_transfer_pb2 as pb

MAX_IDLE_CONNECTIONS = 8  # a sender keeps at most this many connections open between sessions


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
        ("begin", "layer_done", "commit", "receiver_instance"); TransferError if it failed (with the
        status name the RPC would carry) or did not come within timeout_s."""
        assert self.num_pending, "no request is waiting for a reply"
        try:
            self._sock.settimeout(timeout_s)
            data = self._sock.recv(MAX_CONTROL_MESSAGE_BYTES)
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

    def __init__(self, path: str, receiver_instance: str, timeout_s: float,
                 takes_begin: bool = False) -> None:
        self.path = path
        self.receiver_instance = receiver_instance
        self.takes_begin = takes_begin  # the receiver answers Begin here too (its handshake)
        self._timeout_s = timeout_s  # connect and hello
        self._idle: list[LocalChannel] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, path: str, receiver_instance: str, timeout_s: float,
             takes_begin: bool = False) -> LocalControlClient:
        """Connect once to check that `path` reaches the receiver `receiver_instance`; raises
        TransportRefusedError (with the reason) if it does not."""
        client = cls(path, receiver_instance, timeout_s, takes_begin)
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
