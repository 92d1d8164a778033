"""The shm transport: the decode KV pool lives in a shared-memory file, and a prefill worker on
the same host maps it and writes each layer straight into the reserved blocks.

    decode worker                              prefill worker (same host)
    SharedKVPool.create(layout, num_blocks)    connect("shm", target, layout)
      /dev/shm/pdserve-kv-<pid>-<rand>.kv  <--   handshake returns path, st_dev, st_ino
      pool.tensor (MAP_SHARED)                   SharedKVPool.attach(): the same pages;
                                                 index_copy_ into the dst blocks, LayerDone
Control (Begin, LayerDone, Commit, Abort) goes over the KVTransfer gRPC service.

Lifetime of the file (no multiprocessing.shared_memory, whose resource tracker in Python 3.11
unlinks segments that another process merely attached):
- The owner holds an exclusive flock on the file while it lives; close() (or garbage
  collection, or interpreter exit) unlinks it. Mappings stay valid until their tensors die.
- kill -9 of the owner leaves the file behind, and tmpfs keeps its pages while the name
  exists. The kernel drops the flock with the process, so the next SharedKVPool.create() on
  the host, or reap_stale_pools(), unlinks every pool file whose flock is free. The memory
  returns once the last mapping (a prefill worker still attached) is gone.
- Space is reserved up front (posix_fallocate): a /dev/shm too small (Docker's default is
  64 MiB) fails in create() with a clear error, not with SIGBUS on first touch.
- attach() checks (st_dev, st_ino): two containers with private /dev/shm mounts share a host
  id (same kernel) but not the file, and must fail loudly rather than write elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import secrets
import time
import weakref

import torch

from engine_core.kv_cache.layout import KVLayout
from kv_transfer.errors import TransportRefusedError
from kv_transfer.transports.base import Pair, ReceiverPool, device_type
from kv_transfer.transports.one_sided import OneSidedTransport
from protos.pdserve.internal import kv_transfer_pb2 as pb

log = logging.getLogger("pdserve.kv_transfer")

DEFAULT_DIR = "/dev/shm"
POOL_PREFIX = "pdserve-kv"
_TMP_GRACE_S = 60.0  # a half-created pool file younger than this is left alone by the reaper


class ShmTransport(OneSidedTransport):
    """Same host, a decode pool in host memory (a SharedKVPool): the sender maps its file and
    copies each layer into the reserved blocks."""

    name = "shm"
    wire_kind = pb.TRANSPORT_KIND_SHM
    auto_rank = 20

    def unavailable_reason(self, pair: Pair) -> str | None:
        if reason := pair.other_host_reason():
            return reason
        if device_type(pair.receiver_device) == "cuda":
            return f"the decode KV pool is on {pair.receiver_device}, not in host shared memory"
        return None

    def receiver_refusal(self, device: str) -> str | None:
        if device_type(device) == "cpu":
            return None
        return (f"shm is a host-memory pool, but this decode worker's KV cache is on {device}; "
                f"use grpc or cuda_ipc")

    def receiver_pool(self, layout: KVLayout, num_blocks: int) -> SharedKVPool:
        return SharedKVPool.create(layout, num_blocks)

    def can_receive(self, pool: ReceiverPool) -> bool:
        return pool.shm_pool is not None

    def export(self, pool: ReceiverPool) -> SharedKVPool:
        assert isinstance(pool.shm_pool, SharedKVPool)
        return pool.shm_pool

    def export_to_proto(self, export: SharedKVPool, reply: pb.HandshakeResponse) -> None:
        reply.shm.CopyFrom(pb.ShmPool(path=export.path, size_bytes=export.size_bytes,
                                      st_dev=export.identity[0], st_ino=export.identity[1]))

    def attach(self, reply: pb.HandshakeResponse, layout: KVLayout) -> torch.Tensor:
        return SharedKVPool.attach(reply.shm.path, layout, reply.num_blocks,
                                   identity=(reply.shm.st_dev, reply.shm.st_ino)).tensor


TRANSPORT = ShmTransport()


class SharedKVPool:
    """A KV cache tensor [num_layers, num_blocks, 2, block_size, heads, dim] backed by a
    shared file. Create it in the decode worker (the owner); attach in the prefill worker."""

    def __init__(self, path: str, tensor: torch.Tensor, identity: tuple[int, int],
                 fd: int | None) -> None:
        self.path = path
        self.tensor = tensor
        self.identity = identity  # (st_dev, st_ino) of the file
        self.is_owner = fd is not None
        self._finalizer = weakref.finalize(self, _unlink_and_unlock, path, fd) \
            if fd is not None else None

    @property
    def size_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int,
               directory: str = DEFAULT_DIR) -> SharedKVPool:
        """A new zeroed pool under `directory`, owned by this process."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        reap_stale_pools(directory)
        size = layout.num_layers * num_blocks * layout.block_nbytes
        name = f"{POOL_PREFIX}-{os.getpid()}-{secrets.token_hex(6)}"
        tmp, path = os.path.join(directory, name + ".tmp"), os.path.join(directory, name + ".kv")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until we close or die
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                stat = os.statvfs(directory)
                raise OSError(e.errno, f"cannot reserve {size} bytes in {directory} for the KV "
                                       f"pool ({stat.f_bavail * stat.f_frsize} free); raise the "
                                       f"shm size (docker --shm-size, a memory emptyDir)") from e
            os.rename(tmp, path)  # visible to the reaper only once locked and sized
            tensor = _map(fd, layout, num_blocks)
        except BaseException:
            os.close(fd)
            for p in (tmp, path):
                if os.path.exists(p):
                    os.unlink(p)
            raise
        st = os.fstat(fd)
        log.info("KV pool in shared memory: %s (%.1f MiB)", path, size / 2**20)
        return cls(path, tensor, (st.st_dev, st.st_ino), fd)

    @classmethod
    def attach(cls, path: str, layout: KVLayout, num_blocks: int,
               identity: tuple[int, int] | None = None) -> SharedKVPool:
        """Map an existing pool (sender side). `identity` is the owner's (st_dev, st_ino)."""
        try:
            fd = os.open(path, os.O_RDWR)  # never O_CREAT: a vanished pool is an error
        except OSError as e:
            raise TransportRefusedError(
                f"shm pool {path} cannot be opened here ({e.strerror}): the prefill and decode "
                f"workers must share /dev/shm (same host, shared IPC / emptyDir)") from e
        try:
            st = os.fstat(fd)
            if identity is not None and (st.st_dev, st.st_ino) != tuple(identity):
                raise TransportRefusedError(
                    f"{path} here is not the decode worker's pool (device/inode "
                    f"{(st.st_dev, st.st_ino)} != {tuple(identity)}): separate /dev/shm mounts")
            expected = layout.num_layers * num_blocks * layout.block_nbytes
            if st.st_size != expected:
                raise TransportRefusedError(f"shm pool {path} has {st.st_size} bytes, the "
                                            f"layout needs {expected}")
            tensor = _map(fd, layout, num_blocks)
        finally:
            os.close(fd)
        return cls(path, tensor, (st.st_dev, st.st_ino), None)

    def close(self) -> None:
        """Owner: unlink the file and drop the lock. Existing mappings stay valid until their
        tensors are garbage collected; no new process can attach."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> SharedKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reap_stale_pools(directory: str = DEFAULT_DIR) -> list[str]:
    """Unlink pool files whose owner has died (their flock is free); returns their paths."""
    reaped = []
    for path in glob.glob(os.path.join(directory, f"{POOL_PREFIX}-*")):
        try:
            if path.endswith(".tmp") and time.time() - os.path.getmtime(path) < _TMP_GRACE_S:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or another user's file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner is alive
        finally:
            os.close(fd)  # also drops the lock we may have taken
        try:
            os.unlink(path)
            reaped.append(path)
        except FileNotFoundError:
            pass
    if reaped:
        log.warning("removed %d KV pool file(s) left by dead processes: %s", len(reaped), reaped)
    return reaped


def _map(fd: int, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    shape = layout.cache_shape(num_blocks)
    numel = layout.num_layers * num_blocks * layout.block_numel
    # /proc/self/fd reopens this very inode, even if its name has been unlinked meanwhile.
    flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel,
                           dtype=layout.torch_dtype)
    return flat.view(shape)


def _unlink_and_unlock(path: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)
