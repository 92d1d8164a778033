"""The disaggregated orchestration: a request driven through a decode worker's reservation,
a prefill (on the prefill pool, on the decode worker itself, or shared with a fork's parent)
and the decode worker's output stream. Knows nothing of the OpenAI front end
(gateway/openai/ is the other half; an import-linter contract keeps the two apart).

    backend             DisaggregatedBackend: a request's life, end to end
    discovery           where the workers are (static); redis_discovery: the Redis registry
    worker_pools        the pools as discovery and Status say; worker_calls: what steps share
    routing             which prefill worker, which decode workers first (pure functions)
    decode_admission    a reservation on the decode pool, or a bounded wait for one
    prefill_policy      local or remote prefill (a pure cost model); prefill_placement: its inputs
    prefill_handoff     the remote prefill: the prompt and the reservation to a prefill worker
    forks               the n samples of one prompt share its prefill
    decode_stream       this gateway's output stream to one decode worker
    pair_health         (prefill, decode) pairs whose handoffs failed lately
    canary              synthetic requests that prove the pipeline works
"""
