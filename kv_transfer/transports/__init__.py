"""The KV transports, one module each, and the registry that every choice of a transport reads:
selection (negotiation.py), both sides of the handoff, the CLIs' --transport(s) choices, the
metric labels, and the helm chart's schema (tests/helm checks its enum against names()).

A transport is a module here, named as the transport, that defines TRANSPORT (an instance of a
base.Transport subclass: what it declares is listed in base.py), plus its name in one of the
tuples below. one_sided.py is what the one-sided transports share, not a transport. The
registry imports a module on first use: the CLIs read names() without importing torch or grpc.
"""

from __future__ import annotations

import importlib

from kv_transfer.transports.base import Transport

# What users choose from, in listing order (CLI choices, metric labels, the chart's enum).
_TRANSPORTS = ("grpc", "shm", "cuda_ipc")
# In-process transports for tests: hidden from names() and never chosen by "auto".
_FOR_TESTS: tuple[str, ...] = ("fake",)

_loaded: dict[str, Transport] = {}


def names(*, include_tests: bool = False) -> tuple[str, ...]:
    """The transports' names, in listing order; those for tests only if asked."""
    return _TRANSPORTS + _FOR_TESTS if include_tests else _TRANSPORTS


def get(name: str) -> Transport:
    """The transport called `name`; ValueError if there is none."""
    transport = _loaded.get(name)
    if transport is not None:
        return transport
    if name not in names(include_tests=True):
        raise ValueError(f"unknown transport {name!r}; choose one of "
                         f"{', '.join(names(include_tests=True))}")
    transport = importlib.import_module(f"{__name__}.{name}").TRANSPORT
    assert transport.name == name, f"module {name} declares transport {transport.name!r}"
    _loaded[name] = transport
    return transport


def all_transports(*, include_tests: bool = True) -> list[Transport]:
    """Every registered transport (loading their modules), in listing order."""
    return [get(name) for name in names(include_tests=include_tests)]
