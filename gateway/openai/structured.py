"""Checks a request's structured output before it goes anywhere: the grammar compiles, off the
event loop, for the served model's tokenizer (llguidance's LLTokenizer, built once per
tokenizer). Compiled grammars are cached by the grammar (engine_core/structured_output.py), so
a schema sent again costs a dictionary look-up. A colocated gateway uses its engine's compiler:
the engine thread then only copies the compiled matcher."""

from __future__ import annotations

import asyncio
import threading

from engine_core.structured_output import GrammarCompiler, StructuredOutput
from service_infra.backend import Backend

_lock = threading.Lock()
_compilers: dict[int, GrammarCompiler] = {}  # by id() of the backend's tokenizer


def _compiler(backend: Backend) -> GrammarCompiler:
    engine = getattr(backend, "engine", None)  # colocated: share the engine's compiler, so
    if engine is not None and getattr(engine, "tokenizer", None) is backend.tokenizer:
        return engine.grammar_compiler  # the engine thread finds the grammar compiled
    tokenizer = backend.tokenizer
    with _lock:
        compiler = _compilers.get(id(tokenizer))
        if compiler is None:
            compiler = GrammarCompiler(tokenizer.hf, backend.model.vocab_size,
                                       tokenizer.eos_token_ids)
            _compilers[id(tokenizer)] = compiler
        return compiler


NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
         "choice": "choice list", "grammar": "grammar"}  # a StructuredOutput kind, in errors


async def compile_error(backend: Backend, so: StructuredOutput) -> str | None:
    """Why `so` does not compile for the backend's tokenizer; None when it does."""
    try:
        await asyncio.to_thread(lambda: _compiler(backend).matcher(so))
    except ValueError as e:
        return f"not a valid {NAMES.get(so.kind, so.kind)}: {str(e)[:500]}"
    return None
