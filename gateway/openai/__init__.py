"""The OpenAI front end: a public request (OpenAI JSON, or gRPC) in, its choices' output out,
in OpenAI's shapes. Knows nothing of where a request runs (gateway/disagg/ is the other half;
an import-linter contract keeps the two apart).

    validation          a request -> GenerateInput (model limits, sampling bounds)
    protocol            /v1/completions and /v1/chat/completions bodies -> OpenAIRequest
    structured_fields   response_format / structured_outputs / guided_* -> StructuredOutput
    structured          the grammar compiles, off the event loop
    choices             the n samples of a request as one stream of (choice index, chunk)
    response_objects    OpenAI's response and chunk objects from GenerateChunks
    chat_output         a chat choice's text -> reasoning, content, tool calls
    reasoning, harmony  <think> parsing; GPT-OSS's channels
    tools, tool_stream  tool calling: rendering, and calls parsed as the text grows
    responses_api       POST /v1/responses over the chat path (responses_stream: its events)
    tokenize_api        vLLM's /tokenize and /detokenize
    grpc_chat           a gRPC chat rendered and split as /v1/chat/completions does
    sse                 server-sent events, one ASGI write per event
"""
