"""The `simplefsdp` command starts without importing torch ([Note: lazy package exports] in
`simplefsdp/_lazy.py`): the help and a bad flag of each subcommand answer at once, in a
fresh interpreter where `torch` never appears in `sys.modules`. And the lazy package gives users
what the eager one did."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

# each command, its exit code, and text its stdout (0) or stderr (2) starts with
_COMMANDS = [
    ([], 2, "usage: simplefsdp <command>"),
    (["--help"], 0, "usage: simplefsdp <command>"),
    (["train", "--help"], 0, "usage: simplefsdp train"),
    (["train", "--steps", "x"], 2, "simplefsdp train: error: argument --steps: invalid int value: 'x'"),
    (["train", "--strategy", "BOGUS"], 2, "simplefsdp train: error: argument --strategy: invalid choice: 'BOGUS'"),
    (["train", "--bogus"], 2, "simplefsdp train: error: unrecognized arguments: --bogus"),
    (["train", "--n-heads", "3"], 2, "simplefsdp train: error: dim (128) must be n_heads (3) times an even head dim"),
    (
        ["train", "--gather-dtype", "int8", "--gather-block", "12"],
        2,
        "simplefsdp train: error: gather_block must be a power of two from 8 to 8192, got 12",
    ),
    (["inspect", "--help"], 0, "usage: simplefsdp inspect"),
    (["inspect", "tiny", "--wrld", "8"], 2, "simplefsdp inspect: error: unrecognized arguments: --wrld"),
    (["inspect", "tiny", "--ac", "some"], 2, "simplefsdp inspect: error: argument --ac: invalid choice: 'some'"),
    (
        ["inspect", "tiny", "--gather-dtype", "int8", "--gather-block", "100"],
        2,
        "simplefsdp inspect: error: argument --gather-block: must be a power of two from 8 to 8192, got 100",
    ),
    (["inspect", "tiny", "--gather-dtype", "int4"], 2, "simplefsdp inspect: error: argument --gather-dtype: invalid"),
    (
        ["inspect", "tiny", "--gather-block", "64"],
        2,
        "simplefsdp inspect: error: --gather-block (64) is for a quantized --gather-dtype; got none",
    ),
    (
        ["inspect", "tiny", "--advise-lossy", "search"],
        2,
        "simplefsdp inspect: error: --advise-lossy says what --advise does with quantized gathers: give --advise",
    ),
    (["calibrate", "--help"], 0, "usage: simplefsdp calibrate"),
    (["calibrate", "--nproc", "1"], 2, "usage: simplefsdp calibrate"),
    (["frobnicate"], 2, "simplefsdp: unknown command 'frobnicate'"),
]

_SCRIPT = """
import contextlib, io, json, sys
import simplefsdp.cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = simplefsdp.cli.main(argv)
        except SystemExit as stop:  # argparse's own help and errors (calibrate)
            rc = stop.code
    results.append([rc, out.getvalue(), err.getvalue(), sorted(m for m in sys.modules if m.split(".")[0] == "torch")])
print(json.dumps(results))
"""


def test_help_and_bad_flags_answer_without_importing_torch():
    import json

    argvs = [argv for argv, _, _ in _COMMANDS]
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(argvs)], capture_output=True, text=True, timeout=60, check=True
    )
    for (argv, code, start), (rc, out, err, torch_modules) in zip(_COMMANDS, json.loads(done.stdout), strict=True):
        assert not torch_modules, f"simplefsdp {' '.join(argv)} imported {torch_modules[:3]}"
        assert rc == code, (argv, rc, out, err)
        assert (out if code == 0 else err).startswith(start), (argv, out, err)
        assert not (err if code == 0 else out), (argv, out, err)


def test_the_lazy_package_exports_what_the_eager_one_did():
    """Every public name resolves to the object its module defines, is listed by `dir()`, and
    `simplefsdp.wrap` stays the function after something imports the `simplefsdp.wrap` module."""
    import importlib

    import simplefsdp.wrap  # binds the submodule to the package's attribute, as any import of it does
    from simplefsdp import materialize, wrap

    assert callable(simplefsdp.wrap)
    assert wrap is simplefsdp.wrap is sys.modules["simplefsdp.wrap"].wrap
    assert materialize is importlib.import_module("simplefsdp.materialize").materialize
    assert isinstance(simplefsdp.gloo, types.ModuleType)
    assert set(simplefsdp.__all__) <= set(dir(simplefsdp))
    for name in simplefsdp.__all__:
        value = getattr(simplefsdp, name)
        home = value if isinstance(value, types.ModuleType) else sys.modules[value.__module__]
        assert home.__name__.startswith("simplefsdp"), (name, home)
    for package in ("simplefsdp.train", "simplefsdp.inspect", "simplefsdp.calibrate"):
        module = importlib.import_module(package)
        assert all(getattr(module, name) is not None for name in module.__all__), package
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        simplefsdp.no_such_name  # noqa: B018


_BACKEND_SCRIPT = """
import os, sys
import simplefsdp
assert "torch" not in sys.modules, "import simplefsdp imported torch"
import torch
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
model = simplefsdp.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
torch.compile(model, backend="simplefsdp_aot_eager")(torch.randn(2, 4)).sum().backward()
assert all(p.grad is not None for p in model.parameters())
dist.destroy_process_group()
print("compiled")
"""


@pytest.mark.slow  # a fresh interpreter importing torch and compiling: seconds; nothing else checks the order
def test_the_debugging_backend_is_registered_once_wrap_is_used():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", _BACKEND_SCRIPT, str(port)], capture_output=True, text=True, timeout=170, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("compiled")


def test_the_profile_names_read_without_the_cost_model_are_its_profiles():
    from simplefsdp.passes import cost
    from simplefsdp.settings import profile_names

    assert profile_names() == sorted(cost.PROFILES)
