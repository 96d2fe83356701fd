"""Class swaps: how simplefsdp adds behaviour to a user's module while its names stay the same.

[Note: class swaps]
Four features give a module a subclass of its own class instead of wrapping it in another module,
so that parameter names, state-dict keys and `isinstance` checks do not change:

- `GatherOnAccess[<class>]` (`parametrize.py`): properties that gather each sharded parameter;
- `Region[<class>]` (`regions.py`): a repeated block whose body compiles once, as a nested region;
- `Checkpointed[<class>]` (`activation_checkpoint.py`): a forward under activation checkpointing;
- `PassOnCompile[<class>]` (`passes/install.py`): a root forward that compiles with the model's pass
  (`CompileScope[<class>]` with passes off: its compiles get the per-rank cache keys only).

They stack (`PassOnCompile[GatherOnAccess[Checkpointed[Block]]]`), and each name says what its
layer adds, so `repr(model)` and a traceback show what happened. Messages to a user name the
user's own class (`user_class`), never a swapped one.
"""

from __future__ import annotations

from torch import nn

__all__ = ["subclass", "user_class"]

_USER_CLASS = "_simplefsdp_user_class"


def user_class(module: nn.Module | type[nn.Module]) -> type[nn.Module]:
    """The class the user wrote, under any number of simplefsdp's swaps."""
    cls = module if isinstance(module, type) else type(module)
    return getattr(cls, _USER_CLASS, cls)


def subclass(cls: type[nn.Module], *, adds: str, attrs: dict[str, object]) -> type[nn.Module]:
    """A subclass of `cls` with `attrs`, named `<adds>[<cls name>]` (callers cache it per `cls`)."""
    return type(f"{adds}[{cls.__name__}]", (cls,), {**attrs, _USER_CLASS: user_class(cls)})
