"""The engine's side of the offload tiers: what is stored, what is looked up, and two threads
that move the bytes off the step path.

    engine thread                                   store thread / load thread
    -------------                                   --------------------------
    a full block is published in the prefix cache
      -> pin it (one more reference), queue it  ->  snapshot its KV (all layers), encode the
                                                    entry, put it in every tier
    next step: unpin what was stored           <-   done
    a waiting request's prefix misses the pool
      -> lookup(): how many more blocks the tiers
         hold (one has() per tier, whole prefix)
      -> the scheduler gives it blocks and parks
         it in WAITING_FOR_OFFLOAD; load()      ->  get each entry from the first tier that
                                                    has it, check it (entry.py), write the
                                                    payloads into its blocks in one copy
    next step: poll(): it rejoins the waiting  <-   (request id, blocks loaded)
      queue with those blocks computed
    a request is preempted
      -> swap_out(): the full blocks it did not ->  put them in every tier that lacks them:
         queue (its reply's; on a decode worker     its reply's under keys of that request's
         the prompt's it received), copied now      own, the prompt's under their shared keys

Stores are write-through at publication, not at eviction: a block is in the tiers by the
time the pool evicts it (eviction copies nothing, on the step path or off it), and a stop or
a crash loses only the queue, so a restart on the same directory finds the chats it served.
A pinned block cannot be evicted or rewritten while its snapshot is taken (the pin ends with
the snapshot, before the tiers' writes). At most `max_pinned` blocks are pinned at once; the
rest wait for a later step, and one the pool evicts meanwhile is not stored (counted in
`num_store_skipped`): a slow tier never holds the pool.

A load writes only into blocks its request holds and nothing else reads (the request is in
no step until the load is polled); an aborted request's blocks are freed only once its load
is done. A block whose entry is missing, unreadable or corrupt ends the load there: the
request computes the rest, and the corrupt entry is dropped from its tier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.kv_offload.entry import decode_entry, encode_entry, entry_key, entry_nbytes
from engine_core.platforms import Platform

logger = logging.getLogger(__name__)

_KNOWN_STORED = 1 << 20  # hashes remembered as stored (skipped without a lookup)
LOAD_SPEED_EWMA_WEIGHT = 0.2  # of the newest load in the measured load speed
# the store thread's niceness: stores are background work, and on a host whose cores the
# workers share (a prefill worker beside a decode worker) they must not take a decode step's
# CPU; loads, which a request waits for, keep the process's priority
STORE_THREAD_NICE = 10


@dataclass
class _Swap:
    """A store job whose bytes were copied on the engine thread (KVOffloader.swap_out)."""

    blocks: list[tuple[int, int]]
    snapshot: torch.Tensor


class KVOffloader:
    def __init__(self, tiers: list, kv_cache: torch.Tensor, namespace: bytes,
                 max_pinned: int, platform: Platform) -> None:
        """tiers: fastest first (tiers.py, redis_tier.py). kv_cache: the engine's cache
        [num_layers, num_blocks, 2, block_size, heads, head_dim] (kv_cache/layout.py).
        platform: the engine's (the threads' device, pinned staging, synchronisation)."""
        if not tiers:
            raise ValueError("KVOffloader needs at least one tier")
        self.tiers = tiers
        self.kv_cache = kv_cache
        self.platform = platform
        self.ns = namespace
        self.max_pinned = max(1, max_pinned)
        num_layers, _, *block = kv_cache.shape
        self._block_shape = (num_layers, *block)  # one block of every layer
        self.payload_nbytes = kv_cache.element_size() * num_layers * int(
            torch.Size(block).numel())
        self._known: OrderedDict[int, None] = OrderedDict()  # hashes stored in the tiers
        self.num_pinned = 0
        self._backlog: list[tuple[int, int]] = []  # published, waiting for room to pin
        self._suspect: set[int] = set()  # after a failed load: stored over, not skipped
        self.num_store_skipped = 0
        self.num_swapped_out = 0  # blocks of preempted requests copied out (swap_out)
        self.num_loads = 0  # requests whose load ran
        self.num_blocks_loaded = 0
        # prompt tokens per second of a request's load (fetch, check, copy into its blocks),
        # a moving average over loads (0: none yet): the gateways weigh a tier hit with it
        self.load_tokens_per_s = 0.0
        self.block_size = kv_cache.shape[3]
        # the most blocks the largest tier holds: what is worth remembering as stored there
        self.capacity_blocks = max(t.capacity_bytes for t in tiers) // entry_nbytes(
            self.payload_nbytes)
        self._stores: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._done_lock = threading.Condition()
        self._stored: list[int] = []  # block ids to unpin; guarded by _done_lock
        self._loaded: list[tuple[str, int]] = []  # (request id, blocks loaded)
        self._threads = [threading.Thread(target=self._serve, args=(q, fn), daemon=True,
                                          name=f"kv-offload-{name}")
                         for name, q, fn in (("store", self._stores, self._store),
                                             ("load", self._loads, self._load))]
        for t in self._threads:
            t.start()

    def key(self, block_hash: int) -> str:
        return entry_key(self.ns, block_hash)

    # -- engine thread ---------------------------------------------------------------------
    def store(self, published: list[tuple[int, int]], pin: Callable[[list[int]], None],
              is_cached: Callable[[int, int], bool]) -> None:
        """Queue newly published (block id, hash) pairs; `pin` takes a reference on blocks
        that will be read (poll() returns them to unpin). Beyond `max_pinned` they wait for
        the next call, and are dropped if the pool evicted them meanwhile (`is_cached(block,
        hash)` is False)."""
        backlog = [(b, h) for b, h in self._backlog if is_cached(b, h)]
        self.num_store_skipped += len(self._backlog) - len(backlog)
        todo = [(b, h) for b, h in backlog + published if h not in self._known]
        room = max(self.max_pinned - self.num_pinned, 0)
        todo, self._backlog = todo[:room], todo[room:]
        if not todo:
            return
        blocks = [b for b, _ in todo]
        pin(blocks)
        self.num_pinned += len(blocks)
        self._stores.put(todo)

    def swap_out(self, blocks: list[tuple[int, int]]) -> None:
        """A preempted request's unpublished (block id, key) pairs, freed right after: copied
        out now (on this thread, in one gather: nothing pins them), stored off the step
        path."""
        self._stores.put(_Swap(blocks, self._snapshot([b for b, _ in blocks])))
        self.num_swapped_out += len(blocks)

    @property
    def has_backlog(self) -> bool:
        return bool(self._backlog)

    def lookup(self, hashes: list[int]) -> int:
        """How many of these consecutive blocks (the prefix after the pool's hit) the tiers
        hold, from the first on: one has() per tier over the whole list."""
        if not hashes:
            return 0
        keys = [self.key(h) for h in hashes]
        held = [False] * len(keys)
        asked = []
        for tier in self.tiers:
            todo = [i for i, h in enumerate(held) if not h]
            if not todo:
                break
            answers = tier.has([keys[i] for i in todo])
            for i, has in zip(todo, answers, strict=True):
                held[i] = has
            asked.append((tier, todo, answers))
        for h, has in zip(hashes, held, strict=True):
            if not has:  # evicted from the tiers since it was stored: store it again
                self._known.pop(h, None)
        n = next((i for i, h in enumerate(held) if not h), len(held))
        for tier, todo, answers in asked:  # misses up to the first block no tier holds
            tier.stats.count("misses", sum(1 for i, has in zip(todo, answers, strict=True)
                                           if i <= n and not has))
        return n

    def load(self, req_id: str, block_ids: list[int], hashes: list[int]) -> None:
        """Fill these blocks (held by the request, in no step) from the tiers; poll() says
        how many, from the first, were."""
        self._loads.put((req_id, list(block_ids), list(hashes)))

    def poll(self) -> tuple[list[tuple[str, int]], list[int]]:
        """(request id, blocks loaded) of finished loads, and blocks whose stores are done
        (to unpin)."""
        with self._done_lock:
            loaded, self._loaded = self._loaded, []
            stored, self._stored = self._stored, []
        self.num_pinned -= len(stored)
        return loaded, stored

    def status(self) -> dict:
        """Each tier's counters (for /internal/status and the benchmark's report)."""
        return {t.name: {"hits": t.stats.hits, "misses": t.stats.misses,
                         "stores": t.stats.stores, "evictions": t.stats.evictions,
                         "corrupt": t.stats.corrupt, "errors": t.stats.errors,
                         "bytes_loaded": t.stats.bytes_loaded, "bytes": t.used_bytes}
                for t in self.tiers}

    def shared_tier_ids(self) -> list[str]:
        """The identities of the tiers other processes reach too (tiers.py `identity`): one
        I/O per tier, so asked once, at a worker's start."""
        ids = (t.identity() for t in self.tiers)
        return [f"{t.name}:{i}" for t, i in zip(self.tiers, ids, strict=True) if i]

    def wait(self, timeout: float) -> None:
        """Until a load or store finishes, or `timeout` seconds."""
        with self._done_lock:
            if not (self._loaded or self._stored):
                self._done_lock.wait(timeout)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued store and load has run (a graceful stop, so that a restart
        finds everything stored); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        for q in (self._stores, self._loads):
            while q.unfinished_tasks:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True

    def close(self) -> None:
        self.drain()
        for q in (self._stores, self._loads):
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    # -- worker threads ----------------------------------------------------------------------
    def _serve(self, q: queue.Queue, fn) -> None:
        self.platform.use_device()  # this thread's copies go to the engine's device
        if fn == self._store:  # Linux: a thread's own niceness (elsewhere: unchanged)
            with contextlib.suppress(AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + STORE_THREAD_NICE)
        while True:
            job = q.get()
            try:
                if job is None:
                    return
                fn(job)
            except Exception:  # a bug, not a tier's failure (tiers do not raise): log, go on
                logger.exception("kv offload job failed")
                if fn == self._load:  # the request must not wait forever
                    self._finish_load(job[0], 0)
            finally:
                q.task_done()

    def _snapshot(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV, block-major and contiguous on the host: [n, layers, 2, bs, h, d]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        return self.kv_cache.transpose(0, 1)[idx].cpu()  # one gather, block-major

    def _store(self, todo: list[tuple[int, int]] | _Swap) -> None:
        if isinstance(todo, _Swap):  # copied out already, nothing pinned
            # (received prompt blocks come under shared keys, maybe stored by their prefill
            # worker into a tier shared with it: those are not written again)
            missing = self._not_everywhere(todo.blocks)
            if not missing:
                return
            snap = todo.snapshot
            if len(missing) < len(todo.blocks):
                keep = {h for _, h in missing}
                snap = snap[[i for i, (_, h) in enumerate(todo.blocks) if h in keep]]
        else:
            # what every tier holds already (another worker of the host stored it: a decode
            # worker's prompt blocks came from a prefill worker that did) is neither read nor
            # written again: one has() per tier for the batch
            missing = self._not_everywhere(todo)
            blocks = [b for b, _ in todo]
            try:
                snap = self._snapshot([b for b, _ in missing]) if missing else None
            finally:  # the bytes are ours now: the pool may have the blocks back
                with self._done_lock:
                    self._stored.extend(blocks)
                    self._done_lock.notify_all()
            if snap is None:
                return
        raw = snap.view(torch.uint8).reshape(len(missing), -1).numpy()
        for i, (_, block_hash) in enumerate(missing):
            key = self.key(block_hash)
            parts = encode_entry(self.ns, block_hash, raw[i])
            ok = True
            replace = block_hash in self._suspect
            self._suspect.discard(block_hash)
            for tier in self.tiers:
                t0 = time.monotonic()
                if tier.put(key, parts, replace):
                    tier.stats.count("stores")
                    tier.stats.observe_store(time.monotonic() - t0)
                else:
                    ok = False
            if ok:
                self._known[block_hash] = None
                if len(self._known) > _KNOWN_STORED:
                    self._known.popitem(last=False)

    def _not_everywhere(self, todo: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The (block, hash) pairs some tier lacks (or must replace); the rest are known."""
        check = [(b, h) for b, h in todo if h not in self._suspect]
        held = [True] * len(check)
        for tier in self.tiers:
            answers = tier.has([self.key(h) for _, h in check])
            held = [a and b for a, b in zip(held, answers, strict=True)]
        for (_, h), everywhere in zip(check, held, strict=True):
            if everywhere:
                self._known[h] = None
        present = {h for (_, h), everywhere in zip(check, held, strict=True) if everywhere}
        return [(b, h) for b, h in todo if h not in present]

    def _load(self, job: tuple[str, list[int], list[int]]) -> None:
        req_id, block_ids, hashes = job
        t_start = time.monotonic()
        payloads = []
        spent = {tier.name: 0.0 for tier in self.tiers}
        for i, block_hash in enumerate(hashes):
            payload = self._fetch(block_hash, spent)
            if payload is None:
                # the request recomputes the rest: their entries, maybe as damaged, are
                # replaced by what it computes
                if len(self._suspect) > _KNOWN_STORED:
                    self._suspect.clear()
                self._suspect.update(hashes[i:])
                for h in hashes[i:]:
                    self._known.pop(h, None)
                break
            payloads.append(payload)
        n = len(payloads)
        if n:
            staged = torch.empty((n, *self._block_shape), dtype=self.kv_cache.dtype,
                                 pin_memory=self.platform.pin_memory)
            flat = staged.view(torch.uint8).reshape(n, -1).numpy()
            for i, p in enumerate(payloads):
                flat[i] = p
            idx = torch.tensor(block_ids[:n], dtype=torch.long, device=self.kv_cache.device)
            self.kv_cache.index_copy_(1, idx, staged.to(self.kv_cache.device).transpose(0, 1))
            self.platform.synchronize()  # in the cache before the request is polled
        for tier in self.tiers:
            if spent[tier.name]:
                tier.stats.observe_load(spent[tier.name])
        self.num_loads += 1
        self.num_blocks_loaded += n
        if n:
            speed = n * self.block_size / max(time.monotonic() - t_start, 1e-6)
            w = LOAD_SPEED_EWMA_WEIGHT
            self.load_tokens_per_s = (speed if self.load_tokens_per_s == 0.0
                                      else (1 - w) * self.load_tokens_per_s + w * speed)
        self._finish_load(req_id, n)

    def _fetch(self, block_hash: int, spent: dict[str, float]):
        """The block's payload from the first tier that has a valid entry, else None."""
        key = self.key(block_hash)
        for tier in self.tiers:
            t0 = time.monotonic()
            data = tier.get(key)
            spent[tier.name] += time.monotonic() - t0
            if data is None:
                tier.stats.count("misses")
                continue
            payload = decode_entry(data, self.ns, block_hash, self.payload_nbytes)
            if payload is None:
                tier.stats.count("corrupt")
                tier.discard(key)
                logger.warning("kv offload tier %s: entry %s is corrupt or truncated; dropped, "
                               "served as a miss", tier.name, key)
                continue
            tier.stats.count("hits")
            tier.stats.count("bytes_loaded", len(data))
            self._known[block_hash] = None
            return payload
        return None

    def _finish_load(self, req_id: str, n: int) -> None:
        with self._done_lock:
            self._loaded.append((req_id, n))
            self._done_lock.notify_all()
