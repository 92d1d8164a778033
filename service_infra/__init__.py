"""What the gateway and the two workers stand on: everything a service process needs that is
neither the engine nor one service's own logic.

    backend.py              the Backend interface: GenerateInput in, GenerateChunk out, and the
                            errors every backend raises
    colocated.py            ColocatedBackend: an LLMEngine on its own thread behind asyncio
                            (the gateway's colocated mode; the engine loop of both workers)
    proto_convert.py        protobuf <-> engine types (sampling parameters, logprobs)
    tls.py                  TLS and mutual TLS on every gRPC hop
    worker_args.py          the flags of the workers, shared with the gateway and `pdserve up`
    worker_server.py        the gRPC server shell of a worker (health, reflection, drain)
    redis_registry.py       the Redis key schema and connection config, shared with the gateway
    worker_registration.py  a worker's entry in Redis: register, heartbeat, publish prefixes
    metrics/                metric names, the workers' exporters, GPU telemetry

It sits below the gateway and the two services and above kv_transfer
(docs/architecture/code-layout.md, "Layers"):
nothing here imports the gateway, a service or the program.
"""
