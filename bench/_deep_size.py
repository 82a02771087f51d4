"""Shared by the benchmark scripts: the deep size of an object graph."""

from __future__ import annotations

import gc
import sys
import types

import numpy as np


def deep_size(root: object) -> int:
    """Bytes of `root` and everything it reaches (numpy data included; not types, modules
    or functions); each object counted once."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)  # an array that owns its data counts it here
        if isinstance(obj, np.ndarray):
            if obj.base is not None:
                stack.append(obj.base)
            continue
        stack.extend(gc.get_referents(obj))
    return total
