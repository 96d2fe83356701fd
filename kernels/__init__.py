"""Fused copy kernels for bucketed collectives; importing this registers `torch.ops.simplefsdp.*`.

[Note: this folder is `simplefsdp.kernels`, never `kernels`]
The repository keeps the package's kernels in a top-level `kernels/` folder, which installs as
`simplefsdp.kernels`. From the repository root -- where the tests and `python -m ...` run, with the
root first on `sys.path` -- `import kernels` would find this folder before Hugging Face's `kernels`
package, which transformers imports by that name. So, imported as `kernels`, this module loads the
installed `kernels` distribution in its own place (found on the rest of `sys.path`), and fails as
an absent module would where none is installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _load_installed_kernels() -> None:
    """Replace this module in `sys.modules["kernels"]` with the installed `kernels` package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _load_installed_kernels()
else:
    from simplefsdp.kernels import copy_ops

    __all__ = ["copy_ops"]
