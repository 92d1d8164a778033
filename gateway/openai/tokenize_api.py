"""vLLM's /tokenize and /detokenize bodies and responses, over the served model's tokenizer.

    POST /tokenize    {"prompt": str, "add_special_tokens": true}
                   or {"messages": [...], "add_generation_prompt": true,
                       "chat_template_kwargs": {...}}  (the chat template)
                      (+ "return_token_strs": false)
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> {"eos_token", "bos_token", "pad_token", "chat_template",
                             "tokenizer_class", "model_max_length"}  (lm-eval's "remote"
                             tokenizer backend reads it)
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.openai.protocol import chat_messages
from gateway.openai.validation import (
    MAX_INLINE_TOKENIZE_CHARS,
    ValidationError,
    check_model,
    check_template_kwargs,
    check_token_ids,
    encode_chat,
)
from service_infra.backend import Backend


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValidationError(name, f"{name} must be a boolean, got {value!r:.40}")
    return value


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValidationError("body", f"the request body must be a JSON object, got "
                              f"{type(body).__name__}")
    return body


async def tokenize(body: Any, backend: Backend) -> dict[str, Any]:
    body = _object(body)
    check_model(body.get("model"), backend)
    tokenizer = backend.tokenizer
    if body.get("messages") is not None:
        ids = await encode_chat(backend, chat_messages(body["messages"]), "messages",
                                _flag(body, "add_generation_prompt", True),
                                template_kwargs=check_template_kwargs(
                                    body.get("chat_template_kwargs")))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValidationError("prompt", f"prompt must be a string (or send messages), got "
                                  f"{prompt!r:.100}")
        add_special = _flag(body, "add_special_tokens", True)
        if len(prompt) <= MAX_INLINE_TOKENIZE_CHARS:
            ids = tokenizer.encode(prompt, add_special)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, prompt, add_special)
    token_strs = tokenizer.convert_ids_to_tokens(ids) \
        if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": backend.model.max_model_len,
            "tokens": ids, "token_strs": token_strs}


async def detokenize(body: Any, backend: Backend) -> dict[str, Any]:
    body = _object(body)
    check_model(body.get("model"), backend)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValidationError("tokens", f"tokens must be a list of token ids, got {ids!r:.100}")
    check_token_ids(ids, "tokens", backend.model.vocab_size)
    return {"prompt": backend.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(backend: Backend) -> dict[str, Any]:
    hf = backend.tokenizer.hf
    return {"eos_token": hf.eos_token, "bos_token": hf.bos_token, "pad_token": hf.pad_token,
            "chat_template": backend.tokenizer.chat_template,  # --chat-template wins
            "tokenizer_class": type(hf).__name__,
            "model_max_length": backend.model.max_model_len}
