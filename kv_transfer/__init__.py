"""The transactional KV handoff from a prefill worker into a decode worker's reserved blocks.

Decode side (receiver):                         Prefill side (sender):
    pool = SharedKVPool.create(layout, n)           conn = connect("auto", target, layout)
    table = LeaseTable(on_release=free_blocks)      session = conn.begin(lease_id, src, dst)
    receiver = KVReceiver(layout, pool.tensor,      session.send_layer(layer, kv_cache) ...
                          table, shm_pool=pool)     stats = session.commit(timeout)
    local = LocalControlServer(receiver).start()
    add_kv_transfer_servicer(server,
                             KVTransferServicer(receiver, local.path))
    lease = table.open(req_id, block_ids, ttl_s)  -> ticket (lease_id, block ids) to prefill
    ... table.get(lease_id).state is COMPLETE -> table.claim(lease_id) -> decode

Layout, each layer importing only those below it (pyproject.toml's import-linter contracts):

    sender.py | receiver/       the two sides: connect() and Connection | KVReceiver with its
                                gRPC service (servicer.py) and same-host socket (control_server.py)
    negotiation.py              transport kinds on the wire, host identity, select_transport
    transports/                 one module per transport, and the registry (names(), get())
    session.py | control_client.py | lease.py
                                the sender's per-request pipeline, its same-host control socket;
                                the receiver's lease state machine
    send_options, wire, checksum, blocks, process, errors

Loopback servers for tests and benchmarks: tests/kv_transfer/loopback.py.
"""

from kv_transfer.checksum import checksum_blocks, checksum_tensor
from kv_transfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseEndedError,
    LeaseError,
    TransferError,
    TransportRefusedError,
    UnknownLeaseError,
    VerificationError,
)
from kv_transfer.lease import Lease, LeaseState, LeaseTable
from kv_transfer.negotiation import host_id, select_transport
from kv_transfer.receiver.control_server import LocalControlServer
from kv_transfer.receiver.kv_receiver import CommitResult, KVReceiver
from kv_transfer.receiver.servicer import KVTransferServicer, add_kv_transfer_servicer
from kv_transfer.send_options import SenderOptions, SendState, TransferStats
from kv_transfer.sender import Connection, connect
from kv_transfer.session import SendSession
from kv_transfer.transports.grpc import GRPC_CHANNEL_OPTIONS, GRPC_SERVER_OPTIONS
from kv_transfer.transports.shm import SharedKVPool, reap_stale_pools

__all__ = [
    "GRPC_CHANNEL_OPTIONS",
    "GRPC_SERVER_OPTIONS",
    "CommitResult",
    "Connection",
    "KVReceiver",
    "KVTransferError",
    "KVTransferServicer",
    "LayoutMismatchError",
    "Lease",
    "LeaseEndedError",
    "LeaseError",
    "LeaseState",
    "LeaseTable",
    "LocalControlServer",
    "SendSession",
    "SendState",
    "SenderOptions",
    "SharedKVPool",
    "TransferError",
    "TransferStats",
    "TransportRefusedError",
    "UnknownLeaseError",
    "VerificationError",
    "add_kv_transfer_servicer",
    "checksum_blocks",
    "checksum_tensor",
    "connect",
    "host_id",
    "reap_stale_pools",
    "select_transport",
]
