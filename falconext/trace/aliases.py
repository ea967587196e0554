"""Rebind import-time aliases of torch.distributed functions in Megatron modules.

A few Megatron modules bind a function to a module global at import time
(``dist_all_gather_func = torch.distributed.all_gather_into_tensor``); replacing the
attribute on ``torch.distributed`` does not reach those. The tracer and the test bed's
emulator both rebind them here, and put them back.
"""

from __future__ import annotations

import sys
from typing import Any

#: modules whose import-time aliases of torch.distributed functions are rebound
ALIAS_MODULE_PREFIXES = ("megatron",)


def rebind_aliases(replace: dict[int, tuple[Any, Any]]) -> list[tuple[dict, str, Any, Any]]:
    """Point module-global aliases of the originals (in Megatron modules) at the wrappers.

    ``replace``: id(original) -> (original, wrapper). Returns the rebindings made, which
    :func:`restore_aliases` undoes (the tracer and the test bed's emulator both use it).
    """
    done: list[tuple[dict, str, Any, Any]] = []
    for modname, module in list(sys.modules.items()):
        if module is None or not _alias_module(modname):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            hit = replace.get(id(value))
            if hit is not None and hit[0] is value:
                namespace[key] = hit[1]
                done.append((namespace, key, hit[0], hit[1]))
    return done


def restore_aliases(
    done: list[tuple[dict, str, Any, Any]], wrappers: dict[int, tuple[Any, Any]]
) -> None:
    """Undo :func:`rebind_aliases`, and unbind wrappers aliased by modules imported since.

    Each alias gets back the very object it held (c10d's function or the wrapper below).
    """
    for namespace, key, orig, wrapper in done:
        if namespace.get(key) is wrapper:
            namespace[key] = orig
    rebind_aliases(wrappers)


def _alias_module(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ALIAS_MODULE_PREFIXES)
