"""A hierarchical KV cache: tiers below the engine's pool that outlive eviction, restarts
and hosts (host RAM, a disk directory, Redis), in the spirit of LMCache, SGLang's HiCache and
vLLM's offloading connector.

    entry.py        an entry's bytes and key (namespace + chained block hash), checked on load
    tiers.py        the cpu and disk tiers, their stats, one log line a minute when degraded
    redis_tier.py   the redis tier
"""
