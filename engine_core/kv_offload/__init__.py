"""A hierarchical KV cache: tiers below the engine's pool that outlive eviction, restarts
and hosts (host RAM, a disk directory, Redis), in the spirit of LMCache, SGLang's HiCache and
vLLM's offloading connector.

    entry.py        an entry's bytes and key (namespace + chained block hash), checked on load
    tiers.py        the cpu and disk tiers, their stats, one log line a minute when degraded
    redis_tier.py   the redis tier
    offloader.py    the engine's side: write-through stores and asynchronous loads, on two
                    threads; the scheduler parks a request in WAITING_FOR_OFFLOAD meanwhile

`build_offloader` makes the tiers an engine's KVOffloadConfig (engine_config.py) asks for.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine_core.engine_config import KVOffloadConfig
from engine_core.kv_offload.entry import namespace, weights_identity
from engine_core.kv_offload.offloader import KVOffloader
from engine_core.kv_offload.redis_tier import RedisTier
from engine_core.kv_offload.tiers import DiskTier, HostTier
from engine_core.platforms import Platform

__all__ = ["KVOffloader", "build_offloader", "tier_names"]

logger = logging.getLogger(__name__)

_GB = 2**30


def tier_names(config: KVOffloadConfig, platform: Platform) -> list[str]:
    """The tiers `config` turns on for an engine on `platform`, fastest first."""
    names = []
    if config.cpu_gb and not platform.kv_in_host_memory:
        names.append("cpu")
    if config.disk_dir and config.disk_gb:
        names.append("disk")
    if config.redis_url and config.redis_gb:
        names.append("redis")
    return names


def build_offloader(config: KVOffloadConfig, platform: Platform, kv_cache: torch.Tensor,
                    layout_fingerprint: str, weights_path: Path, compute: str,
                    num_blocks: int) -> KVOffloader | None:
    """The engine's offloader, or None when no tier is on. `compute`: how the engine computes
    KV from the weights (dtype, prefill weights), part of every key."""
    names = tier_names(config, platform)
    if config.cpu_gb and "cpu" not in names:
        logger.warning("--kv-offload-cpu-gb is ignored on a CPU engine: its KV pool is host "
                       "RAM already (give the pool the memory instead)")
    if not names:
        return None
    ns = namespace(layout_fingerprint, weights_identity(weights_path), compute)
    tiers = []
    for name in names:
        if name == "cpu":
            tiers.append(HostTier(int(config.cpu_gb * _GB)))
        elif name == "disk":
            tiers.append(DiskTier(config.disk_dir, int(config.disk_gb * _GB), ns.hex()))
        else:
            tiers.append(RedisTier(config.redis_url, int(config.redis_gb * _GB), ns.hex()))
    logger.info("kv offload tiers: %s (namespace %s)", ", ".join(
        f"{t.name} {t.capacity_bytes / _GB:g} GiB" for t in tiers), ns.hex())
    # pins last until the store thread's snapshot (about a step): at most half the pool
    return KVOffloader(tiers, kv_cache, ns, max_pinned=num_blocks // 2, platform=platform)
