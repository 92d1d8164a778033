"""What a tier stores for one KV block, and the name it is stored under.

An entry is one full block of every layer (K and V), after a fixed header:

    offset  size  field
    0       4     magic b"PDKV"
    4       2     format version (1)
    6       2     reserved (0)
    8       16    namespace: the model, its KV layout and how its KV is computed (below)
    24      8     the block's chained content hash (kv_cache/block_hash.py)
    32      8     payload length in bytes
    40      8     XXH3-64 of bytes 0..40 and the payload
    48      ...   payload: [num_layers, 2, block_size, num_kv_heads, head_dim] in the cache dtype

A tier is a cache and is never trusted: `decode_entry` returns the payload only when the
magic, the version, the namespace, the block hash, the length and the checksum all agree, so
a torn write, a truncated file, flipped bytes or an entry written for another model or layout
is a miss (and counted as corrupt), never KV served.

The namespace is a digest of the KV layout's fingerprint (model name, dtype, block size,
layers, KV heads, head size), of the weight files' names, sizes and first and last MiB, and
of how the engine computes KV from them (prefill weights, decode activations, quantization):
two engines share entries only when their blocks would hold the same bytes. The block hash
chains every token before the block's end, so a key names the whole prefix.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import xxhash

MAGIC = b"PDKV"
VERSION = 1
_HEADER = struct.Struct("<4sHH16sQQ")  # magic, version, reserved, namespace, hash, length
HEADER_NBYTES = _HEADER.size + 8  # + the checksum
_EDGE = 1 << 20  # bytes of each weight file's head and tail in the namespace


def weights_identity(path: Path) -> str:
    """A cheap identity of a model's weights: each weight file's name and size, and a digest
    of its first and last MiB (a fine-tune of the same shape differs there; hashing whole
    multi-GB files at every start would not be cheap)."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".gguf", ".safetensors", ".bin"))
    h = xxhash.xxh3_128()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            if size > 2 * _EDGE:
                fh.seek(size - _EDGE)
                h.update(fh.read(_EDGE))
    return h.hexdigest()


def namespace(layout_fingerprint: str, weights: str, compute: str) -> bytes:
    """The 16 bytes every key and entry of one engine's KV carries."""
    text = f"layout={layout_fingerprint};weights={weights};compute={compute}"
    return hashlib.sha256(text.encode()).digest()[:16]


def entry_key(ns: bytes, block_hash: int) -> str:
    """The tier's name of a block: its namespace and content hash in hex."""
    return f"{ns.hex()}-{block_hash:016x}"


def encode_entry(ns: bytes, block_hash: int, payload) -> list:
    """The entry's parts (header, payload), to be written one after the other. `payload`:
    bytes or a contiguous buffer of the block's KV."""
    view = memoryview(payload).cast("B")
    head = _HEADER.pack(MAGIC, VERSION, 0, ns, block_hash, view.nbytes)
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(view)
    return [head + struct.pack("<Q", h.intdigest()), view]


def decode_entry(data, ns: bytes, block_hash: int, payload_nbytes: int) -> memoryview | None:
    """The payload of a valid entry for (ns, block_hash) of the expected size, else None."""
    view = memoryview(data).cast("B")
    if view.nbytes != HEADER_NBYTES + payload_nbytes:
        return None
    magic, version, _, got_ns, got_hash, length = _HEADER.unpack_from(view)
    if (magic != MAGIC or version != VERSION or got_ns != ns or got_hash != block_hash
            or length != payload_nbytes):
        return None
    (checksum,) = struct.unpack_from("<Q", view, _HEADER.size)
    h = xxhash.xxh3_64()
    h.update(view[:_HEADER.size])
    payload = view[HEADER_NBYTES:]
    h.update(payload)
    return payload if h.intdigest() == checksum else None


def entry_nbytes(payload_nbytes: int) -> int:
    return HEADER_NBYTES + payload_nbytes


def pid_tag() -> str:
    """A temporary file's suffix unique to this process and call."""
    return f"{os.getpid()}.{os.urandom(4).hex()}"
