"""The repository's top-level `kernels/` folder (installed as `simplefsdp.kernels`) does not stand in
for Hugging Face's `kernels` package, which transformers imports by that name: from the repository
root, where the tests run, `import kernels` is the installed package, and transformers imports
([Note: this folder is `simplefsdp.kernels`, never `kernels`] in kernels/__init__.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHECK = """
import sys, transformers, transformers.modeling_utils  # modeling_utils imports `kernels` where installed
import simplefsdp.kernels
assert sys.path[0] in ("", {root!r}), sys.path[0]
try:
    import kernels
    theirs = kernels.__file__
except ModuleNotFoundError:
    theirs = "absent"
print(transformers.__version__, theirs, simplefsdp.kernels.__file__)
"""


def test_transformers_imports_from_the_repository_root():
    """A fresh interpreter started in the repository root (its first `sys.path` entry) imports
    transformers and the installed `kernels`, and this project's kernels as `simplefsdp.kernels`."""
    done = subprocess.run(
        [sys.executable, "-c", _CHECK.format(root=str(ROOT))], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    version, theirs, ours = done.stdout.split()
    assert version == importlib.metadata.version("transformers")
    assert Path(ours).parent == ROOT / "kernels"
    try:  # transformers >= 5.25 requires it
        installed = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    except importlib.metadata.PackageNotFoundError:
        assert theirs == "absent", "the repository's folder stood in for Hugging Face's kernels"
    else:
        assert Path(theirs) == Path(installed), "the repository's folder stood in for Hugging Face's kernels"


def test_without_an_installed_kernels_the_name_is_absent():
    """Where no `kernels` distribution can be found (here: the installed packages taken off the path),
    importing that name from the repository root fails as for any absent module -- transformers then
    treats it as unavailable -- and never yields this folder."""
    script = (
        "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
        "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
        "else:\n    print('imported', kernels.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "kernels", done.stdout


def test_checkpointed_hugging_face_layers_compile_as_one_graph_per_phase(fake_world8):
    """[Note: side effects in a checkpointed block run once when compiled]: a Llama whose layers are
    checkpointed compiles, wrapped, into one forward and one backward graph. With the `kernels`
    package installed (transformers >= 5.25), each layer's forward sets and resets a module-level
    variable, which Dynamo otherwise refuses inside a checkpointed region."""
    import torch

    import simplefsdp
    from simplefsdp.passes.install import pass_of
    from tests.hf._tiny import llama

    torch.manual_seed(0)
    model = llama()
    simplefsdp.checkpoint_blocks(model)
    simplefsdp.wrap(model)
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, backend="simplefsdp_aot_eager")
    compiled(torch.randint(0, 64, (2, 8))).logits.sum().backward()
    assert not counters["graph_break"], list(counters["graph_break"])
    assert pass_of(model).graphs == 2, "one forward and one backward graph"
