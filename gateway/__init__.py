"""The public front door: gRPC + OpenAI HTTP APIs over a Backend (colocated or disaggregated).

    gateway/            the servers and what serves both halves: server (`pdserve gateway`),
                        http_api, grpc_server, asgi, auth, metrics, tracing_backend,
                        api_servers, cli, client
      openai/           the OpenAI front end: requests, validation, chat, tools, Responses,
                        structured output, reasoning
      disagg/           the disaggregated orchestration: pools, placement, routing, the
                        canary, forks, the handoff

openai/ and disagg/ import neither each other (the `gateway-halves` contract in
pyproject.toml); the servers at the top join them.
"""
