"""The decode worker's side of the KV handoff: KVReceiver (kv_receiver.py: handshake checks,
writes on receipt, verification) and its two edges, the gRPC service (servicer.py) and the
same-host Unix socket (control_server.py). Nothing here imports the sender's side
(kv_transfer/sender.py); both stand on negotiation.py and transports/."""
