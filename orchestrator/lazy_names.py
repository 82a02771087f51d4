"""Names a package re-exports, imported when first used (PEP 562): importing the package
(a reward worker importing `orchestrator.rewards`, `check-config` reading the bearer
token) does not pay for what its re-exports import."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package` that imports each name of `homes` from the
    module it maps to on first use, and keeps it in the package's namespace."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
