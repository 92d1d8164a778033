"""The receiver's end of the same-host control channel of the one-sided transports (shm,
cuda_ipc): LayerDone and Commit over a Unix socket instead of unary gRPC calls (the sender's
end: control_client.py).

On one host a unary gRPC call costs 0.3-1 ms, more once the channel has idled (as it has when
a prefill's last layer is done), while a round trip on a Unix socket costs 10-30 us. Commit is
on the time to first token, so a one-sided sender takes the socket when it can reach it.

    decode worker (receiver)                         prefill worker (sender), same host
    LocalControlServer(receiver).start()             connect(): the handshake names the path
      /dev/shm/pdserve-kvctl-<pid>-<instance>.sock     LocalControlClient.open(path, instance)
      one thread per connection:                        hello -> the receiver's instance id
        request -> receiver.begin / layer_done /      a session takes one connection: its
          commit, reply (errors as gRPC status          Begin, its LayerDones pipelined, then
          names)                                        its Commit

Messages are LocalControlRequest / LocalControlReply (kv_transfer.proto), one per
SOCK_SEQPACKET datagram; a connection's replies come in the order of its requests. The verbs
mean what the RPCs mean, and fail with the same status names (errors.status_name). Begin
comes here too (the handshake says so: HandshakeResponse.local_control_begin): it is not on
the critical path, but as a unary call it cost the decode worker's event loop ~0.5 ms of CPU
per transfer (a loopback unary call to a grpc.aio server, measured on 2 vCPUs), and here it
runs on the connection's thread. Abort stays on gRPC: it must reach the receiver from any
thread while a session's connection waits for a reply.

The commit runs on the connection's thread, never on the gRPC event loop, so a long check
delays only its own sender. A receiver serves at most MAX_CONNECTIONS connections at once (a
thread each); one more is refused with RESOURCE_EXHAUSTED in place of the hello's answer, and
that sender's session keeps its control on gRPC (transports/one_sided.py). Where the socket cannot be
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

from google.protobuf.message import DecodeError

from kv_transfer import wire
from kv_transfer.errors import status_name
from kv_transfer.negotiation import kind_from_proto
from kv_transfer.receiver.kv_receiver import KVReceiver
from kv_transfer.transports.shm import DEFAULT_DIR
from protos.pdserve.internal import kv_transfer_pb2 as pb

log = logging.getLogger("pdserve.kv_transfer")

SOCKET_PREFIX = "pdserve-kvctl"
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
                return pb.LocalControlReply(commit=wire.commit_to_proto(
                    result.num_bytes_verified, result.verify_seconds))
            if verb == "begin":
                msg = request.begin
                remaining_s = self.receiver.begin(
                    msg.lease_id, list(msg.dst_block_ids), kind_from_proto(msg.transport),
                    (msg.sender_pid, msg.sender_start_ticks), msg.receiver_instance)
                return pb.LocalControlReply(begin=pb.BeginResponse(
                    remaining_ms=wire.to_ms(remaining_s)))
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
            if conn.recv(wire.MAX_CONTROL_MESSAGE_BYTES):
                conn.send(reply.SerializeToString())
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """One sender connection: each request answered in turn until it closes."""
        try:
            while data := conn.recv(wire.MAX_CONTROL_MESSAGE_BYTES):
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
