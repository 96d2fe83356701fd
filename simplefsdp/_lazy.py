"""Packages whose public names load on first use: `import simplefsdp` does not import torch.

    __getattr__, __dir__ = lazy_exports(__name__, {"simplefsdp.wrap": ("wrap",)}, submodules=("gloo",))

[Note: lazy package exports]
The `simplefsdp` command imports the package before it parses a flag, and torch alone takes
seconds to import; `simplefsdp --help` or a mistyped flag should answer at once. So a package's
`__init__` names where each public name lives, and the first access to the name (an attribute,
`from simplefsdp import wrap`) imports that module and caches the object in the package's
globals (PEP 562). `__all__` and `dir()` list the same names as an eager `__init__` would.

One trap is handled here: where a public name is also the name of its own submodule
(`simplefsdp.wrap` the function, in `simplefsdp/wrap.py`), importing the submodule from anywhere
makes Python bind the module to the package's attribute, hiding the function. The package's module
class catches that binding and stores the exported object instead -- what the eager `__init__`'s
`from simplefsdp.wrap import wrap` left there.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


class _LazyPackage(types.ModuleType):
    """A package module whose exported names win over same-named submodules ([Note: lazy package exports])."""

    homes: dict[str, str] = {}  # public name -> the module defining it; set per package

    def __setattr__(self, name: str, value: Any) -> None:
        home = type(self).homes.get(name)
        if isinstance(value, types.ModuleType) and value.__name__ == home and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]], *, submodules: Sequence[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`'s `__init__`. `exports` maps a module to the public
    names it defines; `submodules` are public names that are modules of the package themselves."""
    homes = {name: module for module, names in exports.items() for name in names}
    homes.update({name: f"{package}.{name}" for name in submodules})
    namespace = sys.modules[package]
    namespace.__class__ = type("LazyPackage", (_LazyPackage,), {"homes": homes})

    def getattr_(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(homes[name])
        value = module if name in submodules else getattr(module, name)
        namespace.__dict__[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace.__dict__) | set(homes))

    return getattr_, dir_
