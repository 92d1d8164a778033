"""The prefill pool's worker: computes prompts and ships their KV to decode workers."""
