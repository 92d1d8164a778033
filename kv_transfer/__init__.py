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

from __future__ import annotations

import importlib

# The public names, by the module that defines them. Each is imported on first use (PEP 562):
# `import kv_transfer` costs nothing, so the CLIs read the transports' names
# (kv_transfer.transports.names()) without importing torch or grpc.
_EXPORTS = {
    "kv_transfer.checksum": ("checksum_blocks", "checksum_tensor"),
    "kv_transfer.errors": ("KVTransferError", "LayoutMismatchError", "LeaseEndedError",
                           "LeaseError", "TransferError", "TransportRefusedError",
                           "UnknownLeaseError", "VerificationError"),
    "kv_transfer.lease": ("Lease", "LeaseState", "LeaseTable"),
    "kv_transfer.negotiation": ("host_id", "select_transport"),
    "kv_transfer.receiver.control_server": ("LocalControlServer",),
    "kv_transfer.receiver.kv_receiver": ("CommitResult", "KVReceiver"),
    "kv_transfer.receiver.servicer": ("KVTransferServicer", "add_kv_transfer_servicer"),
    "kv_transfer.send_options": ("SenderOptions", "SendState", "TransferStats"),
    "kv_transfer.sender": ("Connection", "connect"),
    "kv_transfer.session": ("SendSession",),
    "kv_transfer.grpc_options": ("GRPC_CHANNEL_OPTIONS", "GRPC_SERVER_OPTIONS"),
    "kv_transfer.transports.shm": ("SharedKVPool", "reap_stale_pools"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
