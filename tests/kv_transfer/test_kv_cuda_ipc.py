"""CUDA IPC: what can be checked without a GPU (field-by-field handle serialization, the torch
API it relies on, refusals), and a real same-host GPU transfer when CUDA exists."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from kv_helpers import LAYOUTS, same_bits
from torch.multiprocessing import reductions

from kv_transfer import TransportRefusedError, connect
from kv_transfer.transports.cuda_ipc import (
    REBUILD_PARAMS,
    CudaIpcHandle,
    export_handle,
    handle_from_proto,
    handle_to_proto,
    open_handle,
)

LAYOUT = LAYOUTS[1]


def fake_handle(**overrides) -> CudaIpcHandle:
    fields = dict(
        device_index=1, mem_handle=os.urandom(64), storage_size_bytes=123456,
        storage_offset_bytes=512, ref_counter_handle=b"/torch_1234_567_0", ref_counter_offset=3,
        event_handle=os.urandom(64), event_sync_required=True,
        tensor_size=LAYOUT.cache_shape(10),
        tensor_stride=torch.empty(LAYOUT.cache_shape(10), device="meta").stride(),
        tensor_offset=0, dtype=LAYOUT.dtype)
    return CudaIpcHandle(**{**fields, **overrides})


def test_handle_survives_the_proto_round_trip_field_by_field():
    handle = fake_handle()
    wire_bytes = handle_to_proto(handle).SerializeToString()
    from protos.pdserve.internal import kv_transfer_pb2 as pb

    assert handle_from_proto(pb.CudaIpcHandle.FromString(wire_bytes)) == handle


@pytest.mark.parametrize(("overrides", "message"), [
    ({"mem_handle": b"\x00" * 10}, "mem_handle must be 64 to 256 bytes, got 10"),
    ({"mem_handle": b"\x00" * 257}, "mem_handle must be 64 to 256 bytes, got 257"),
    ({"dtype": "int64"}, "dtype must be one of"),
    ({"tensor_offset": -1}, "negative"),
    ({"tensor_stride": (1, 2)}, "differ in length"),
])
def test_malformed_handles_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        fake_handle(**overrides)


def test_rebuild_cuda_tensor_still_takes_the_fields_we_send():
    """Guards against torch changing the signature our handle is built for."""
    params = tuple(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params == REBUILD_PARAMS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refused_without_cuda():
    with pytest.raises(TransportRefusedError, match="KV pool on a GPU"):
        export_handle(torch.zeros(2))
    with pytest.raises(TransportRefusedError, match="no CUDA|none is available"):
        open_handle(fake_handle(), LAYOUT, 10)
    with pytest.raises(TransportRefusedError, match="cuda_ipc"):
        connect("cuda_ipc", "127.0.0.1:1", LAYOUT)  # refused before any network call


@pytest.mark.gpu
def test_cuda_ipc_transfer_between_processes(seed):
    """The decode pool lives on the GPU of a child process; this process opens its IPC
    handle and copies device to device. CUDA IPC handles never open in their own process."""
    from tests.kv_transfer.loopback import ReceiverProcess

    gen = torch.Generator().manual_seed(seed)
    src_kv = torch.randn(LAYOUT.cache_shape(16), generator=gen).to(LAYOUT.torch_dtype).cuda()
    src_ids = torch.randperm(16, generator=gen)[:5].tolist()
    with ReceiverProcess(LAYOUT, 32, use_shm=False, device="cuda") as receiver:
        lease_id, dst_ids = receiver.call("open", 5, 30.0)
        with connect("auto", receiver.target, LAYOUT, device="cuda:0") as conn:
            assert conn.kind == "cuda_ipc"
            session = conn.begin(lease_id, src_ids, dst_ids)
            for layer in range(LAYOUT.num_layers):
                assert session.send_layer(layer, src_kv)
            stats = session.commit(timeout=30)
        assert stats.transport == "cuda_ipc"
        assert receiver.call("claim", lease_id) == dst_ids
        assert same_bits(receiver.call("read", dst_ids), src_kv[:, src_ids].cpu())
