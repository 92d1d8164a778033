"""gRPC options of every channel and server between the stack's processes: message sizes for
the KV transfer's chunks, keepalive that finds a silent peer, fast reconnects. No torch: the
gateway's worker channels use them too."""

from __future__ import annotations

from kv_transfer.send_options import MAX_CHUNK_BYTES

# A chunk message is its payload plus a few bytes per block id and framing; 1 MiB of headroom.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)

# A peer that stops answering (a partition drops packets silently: no reset, no error) is
# found by HTTP/2 keepalive pings: both ends ping every KEEPALIVE_TIME_S, idle or not, and
# close the connection when an ack takes longer than KEEPALIVE_TIMEOUT_S. Its calls then fail
# UNAVAILABLE (the gateway runs them again elsewhere; a worker aborts what the lost caller
# had running), within KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S of the silence, where TCP
# alone would retransmit for ~15 minutes.
KEEPALIVE_TIME_S = 5
KEEPALIVE_TIMEOUT_S = 5
_KEEPALIVE = {
    "grpc.keepalive_time_ms": KEEPALIVE_TIME_S * 1000,
    "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_S * 1000,
    "grpc.keepalive_permit_without_calls": 1,
    # no limit on pings without data frames in between (the default, 2, makes the peer
    # close an idle connection with GOAWAY too_many_pings)
    "grpc.http2.max_pings_without_data": 0,
}

# Reuse these where the KVTransfer service is served or called: pass list(d.items()).
GRPC_SERVER_OPTIONS: dict[str, int] = {
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    **_KEEPALIVE,
    # accept the callers' pings every KEEPALIVE_TIME_S (the default minimum is 5 minutes
    # without data; more frequent pings count as strikes, and strikes close the connection)
    "grpc.http2.min_ping_interval_without_data_ms": KEEPALIVE_TIME_S * 1000 // 2,
    "grpc.http2.max_ping_strikes": 0,
}
GRPC_CHANNEL_OPTIONS: dict[str, int] = {
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    **_KEEPALIVE,
    "grpc.enable_retries": 0,  # a half-sent stream must fail, not be replayed
    # a worker restarted at its address is reached again within ~2 s: under gRPC's default
    # reconnect backoff (growing to 120 s) a peer down for a minute can stay unreachable for
    # half a minute after it is back
    "grpc.initial_reconnect_backoff_ms": 500,
    "grpc.min_reconnect_backoff_ms": 500,
    "grpc.max_reconnect_backoff_ms": 2000,
}
