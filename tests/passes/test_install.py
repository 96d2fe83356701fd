"""The pass chain `install.py` builds around a user's own post-grad pass (no compiling here)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from torch import fx

from simplefsdp._compat import (
    CustomGraphModulePass,
    CustomGraphPass,
    CustomInferenceAwareGraphPass,
    backend_graph_passes,
    functorch_config,
    inductor_config,
    run_and_get_code,
)
from simplefsdp.passes.fsdp_pass import FsdpPass
from simplefsdp.passes.install import ChainedPass, FoldUnevenPadding, configured_passes, installed, running


class _Named(CustomGraphPass):
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __call__(self, graph: fx.Graph) -> None:
        self.log.append(self.name)

    def uuid(self) -> str:
        return self.name


class _Module(CustomGraphModulePass):
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __call__(self, gm: fx.GraphModule) -> None:
        self.log.append(self.name)

    def uuid(self) -> str:
        return self.name


# torch 2.11 has no inference-aware pass class (`_compat` gives None): the stand-in base keeps this
# module importable there; the tests that use `_Aware` skip without the real class
class _Aware(CustomInferenceAwareGraphPass or CustomGraphPass):
    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, graph: fx.Graph, is_inference: bool) -> None:
        self.log.append(("aware", is_inference))

    def uuid(self) -> str:
        return "aware"


def test_ours_runs_first_then_the_users():
    log, ours = [], FsdpPass()
    user = _Named("user", log)
    with inductor_config.patch(post_grad_custom_post_pass=user):
        assert installed() == (user,)
        with running((ours,)):
            assert installed() == (ours, user), "ours first, then the user's"
            assert inductor_config.post_grad_custom_post_pass is None, "the user's moved into the chain"
            with running((ours,)):
                assert installed() == (ours, ours, user), "a nested block chains (compile_scope() checks first)"
            assert installed() == (ours, user)
            ChainedPass(installed())(fx.Graph())
        assert installed() == (user,), "restored on exit"
    assert log == ["user"]
    assert ours.graphs == 1


@pytest.mark.skipif(
    backend_graph_passes is None or CustomInferenceAwareGraphPass is None, reason="needs both pass kinds"
)
def test_an_inference_aware_pass_keeps_its_slot_and_its_flag():
    log, ours = [], FsdpPass()
    aware, user = _Aware(log), _Named("user", log)
    with inductor_config.patch(post_grad_custom_post_pass=[aware, user]), running((ours,)):
        assert installed() == (aware, ours, user), "inductor runs the slot first, then the chain"
        inductor_config.post_grad_custom_post_pass(fx.Graph(), is_inference=True)
    assert log == [("aware", True)]


@pytest.mark.skipif(backend_graph_passes is None, reason="this torch has no backend graph passes")
def test_the_chain_runs_once_per_graph_after_the_fake_tensor_update():
    """[Note: where the pass runs]: installed for every device type, run once on a graph that holds
    tensors of several, and the entry it displaced still runs after it."""
    log = []
    with running((_Named("ours", log),)):
        entries = [backend_graph_passes[d] for d in ("cpu", "cuda")]
        displaced = _Module("displaced", log)
        entries[1].then = displaced
        gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
        for entry in entries:
            entry(gm)
        assert log == ["ours", "displaced"]
        assert entries[0].uuid()
        assert entries[0].uuid() != entries[1].uuid(), "the displaced entry is part of the key"
    assert all(not isinstance(v, type(entries[0])) for v in backend_graph_passes.values()), "restored"


def test_the_uneven_padding_fold_runs_first_on_the_joint_graph():
    """[Note: why fold the uneven padding]: `running` puts the fold ahead of a joint-graph pass the
    user configured, once however deeply blocks nest, and restores the slot on exit."""
    log = []
    user = _Named("user", log)
    with inductor_config.patch(joint_custom_pre_pass=user):
        with running((FsdpPass(),)):
            fold, *rest = configured_passes(inductor_config.joint_custom_pre_pass)
            assert isinstance(fold, FoldUnevenPadding)
            assert rest == [user]
            with running((FsdpPass(),)):
                assert configured_passes(inductor_config.joint_custom_pre_pass) == (fold, user), "installed once"
            assert fold.uuid() == FoldUnevenPadding().uuid(), "a cache key of the code, not of the instance"
            inductor_config.joint_custom_pre_pass(fx.Graph())
        assert inductor_config.joint_custom_pre_pass is user, "restored on exit"
    assert log == ["user"]


def test_chain_cache_key():
    log, ours = [], FsdpPass()
    keyed = ChainedPass((ours, _Named("user", log)))
    assert keyed.uuid()
    assert keyed.uuid() != ChainedPass((ours, _Named("other", log))).uuid()
    assert ChainedPass((ours, lambda graph: None)).uuid() is None, "a plain callable cannot key the cache"


@pytest.mark.skipif(CustomInferenceAwareGraphPass is None, reason="this torch has no inference-aware passes")
def test_inference_flag_reaches_aware_passes():
    log = []
    chain = ChainedPass((FsdpPass(), _Aware(log), _Named("plain", log)))
    chain(fx.Graph(), is_inference=True)
    assert log == [("aware", True), "plain"]


def test_models_of_one_class_with_different_passes_compile_apart(fake_world8):
    """Dynamo caches compiled code per code object and does not guard on the pass: a model whose pass
    neither buckets nor reorders, compiled first, must not hand its graphs to a model of the same
    class with the default pass."""
    import torch

    import simplefsdp
    from simplefsdp.models import Transformer, TransformerArgs
    from simplefsdp.passes.install import pass_of

    args = TransformerArgs(n_layers=2)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    plain = simplefsdp.wrap(Transformer(args), passes=simplefsdp.PassConfig(bucket=None, reorder=None))
    torch.compile(plain, backend="simplefsdp_aot_eager")(tokens).sum().backward()
    ours = simplefsdp.wrap(Transformer(args))
    torch.compile(ours, backend="simplefsdp_aot_eager")(tokens).sum().backward()
    assert pass_of(ours).graphs == 2, "the second model compiled its own forward and backward, with its pass"
    assert pass_of(ours).merged > 0


@pytest.mark.slow
def test_pass_cache_key_is_its_configuration():
    """The `uuid()` that keys inductor's caches depends on the configuration, groups, rank and code:
    equal in two fresh processes (no ids, no hash seeds), different when the pass would do something
    else (the rank's part is tested in test_rank_independence.py, the code's below)."""
    import subprocess
    import sys

    from simplefsdp.passes.fsdp_pass import BucketConfig, PassConfig

    script = (
        "from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig;"
        "print(FsdpPass(PassConfig(bucket=BucketConfig(blocks=('layers',))), groups=[(2, 3), (0, 1)]).uuid())"
    )
    runs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True) for _ in range(2)
    ]
    assert runs[0].stdout.strip()
    assert runs[0].stdout == runs[1].stdout
    config, groups = PassConfig(bucket=BucketConfig(blocks=("layers",))), [(0, 1), (2, 3)]
    key = FsdpPass(config, groups=groups).uuid()  # this process may hold a process group: compare here
    assert FsdpPass(config, groups=groups[::-1]).uuid() == key, "groups are a set"
    assert FsdpPass(config, groups=[(0, 1)]).uuid() != key
    assert FsdpPass(dataclasses.replace(config, reorder=None), groups=groups).uuid() != key
    assert FsdpPass(PassConfig(), groups=groups).uuid() != key


_PASS_KEY_SCRIPT = (
    "from simplefsdp.passes.fsdp_pass import FsdpPass, PassConfig;"
    "import simplefsdp.passes.bucket as b; print(b.__file__); print(FsdpPass(PassConfig(), groups=[(0, 1)]).uuid())"
)


def _pass_key_of(copy: pathlib.Path) -> str:
    """The pass's cache key as a fresh process importing simplefsdp from the tree `copy` computes it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(copy)}
    run = subprocess.run(
        [sys.executable, "-c", _PASS_KEY_SCRIPT], capture_output=True, text=True, check=True, env=env, cwd=copy
    )
    imported, key = run.stdout.split()
    assert imported.startswith(str(copy)), f"the copy was not the simplefsdp imported: {imported}"
    return key


@pytest.mark.slow
def test_pass_cache_key_covers_the_pass_source(tmp_path):
    """An edit to the pass's or the kernels' source (an upgrade that forgot to bump anything) changes
    the key, so inductor's caches never serve a graph an older pass wrote."""
    import shutil

    import simplefsdp
    from simplefsdp import kernels, passes

    tree = tmp_path / "simplefsdp"  # the installed layout: passes/ and kernels/ inside the package
    shutil.copytree(pathlib.Path(simplefsdp.__file__).parent, tree, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in (passes, kernels):
        shutil.copytree(pathlib.Path(sub.__file__).parent, tree / sub.__name__.rsplit(".", 1)[1], dirs_exist_ok=True)
    before = _pass_key_of(tmp_path)
    assert _pass_key_of(tmp_path) == before, "the key must be stable for the same source"
    for edited in (tree / "passes" / "bucket.py", tree / "kernels" / "copy_ops.py"):
        edited.write_text(edited.read_text() + "\n# an edit\n")
        after = _pass_key_of(tmp_path)
        assert after != before, f"editing {edited.name} left the cache key unchanged"
        before = after


def test_a_sequential_root_compiles_as_one_graph(fake_world8):
    """A root whose `forward` is torch's own (`nn.Sequential`): Dynamo compiles our entry frame and
    inlines it, one forward and one backward graph, bucketed ([Note: the compiled frame is ours])."""
    import torch

    import simplefsdp
    from simplefsdp.passes.install import pass_of

    model = simplefsdp.wrap(torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3))))
    torch.compile(model, backend="simplefsdp_aot_eager")(torch.randn(2, 8)).sum().backward()
    assert pass_of(model).graphs == 2, "one graph per parameter gather means the layers ran eagerly"
    assert pass_of(model).merged > 0


def test_compiled_inside_a_larger_function_warns_unless_active(fake_world8):
    """A wrapped model traced inside `torch.compile(fn)` gets no passes unless `compile_scope(model)` is
    around the call: the first such trace warns (once), and with `compile_scope` the pass runs and
    nothing warns."""
    import warnings

    import torch

    import simplefsdp
    from simplefsdp.passes.install import compile_scope, pass_of

    def build():
        return simplefsdp.wrap(torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(2))))

    model = build()
    step = torch.compile(lambda x: model(x).sum(), backend="simplefsdp_aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.randn(2, 8)).backward()
        step(torch.randn(3, 8)).backward()  # a recompile (new shape) does not warn again
    assert sum("larger compiled function" in str(w.message) for w in caught) == 1
    assert pass_of(model).graphs == 0, "no active pass, no pass run"

    model = build()
    step = torch.compile(lambda x: model(x).sum(), backend="simplefsdp_aot_eager")
    with warnings.catch_warnings(record=True) as caught, compile_scope(model):
        warnings.simplefilter("always")
        step(torch.randn(2, 8)).backward()
    assert not [w for w in caught if "larger compiled function" in str(w.message)]
    assert pass_of(model).graphs == 2
    assert pass_of(model).merged > 0


def test_the_wrapped_forward_keeps_its_signature(fake_world8):
    """Callers that read `forward`'s parameters (Hugging Face's Trainer keeps the dataset columns the
    model's `forward` names) see the model's own, not the pass wrapper's `(*args, **kwargs)`."""
    import inspect

    import torch

    import simplefsdp

    class Named(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
            return self.linear(input_ids)

    model = simplefsdp.wrap(Named())
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "labels"]


def test_the_pass_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """[Note: the collector paused during the pass]: off while the pass runs, back as it was after --
    also when the pass raises, and left off if the caller had turned it off."""
    import gc

    from simplefsdp.passes import fsdp_pass

    seen = []

    def run(self, graph):
        seen.append(gc.isenabled())
        if len(seen) == 2:
            raise RuntimeError("the pass failed")

    monkeypatch.setattr(fsdp_pass.FsdpPass, "_run", run)
    graph_pass, was = FsdpPass(), gc.isenabled()
    try:
        gc.enable()
        graph_pass(fx.Graph())
        assert gc.isenabled()
        with pytest.raises(RuntimeError, match="the pass failed"):
            graph_pass(fx.Graph())
        assert gc.isenabled()
        gc.disable()
        graph_pass(fx.Graph())
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False, False]


def test_a_cpu_model_compiles_without_buffer_reuse(fake_world8):
    """[Note: no buffer reuse on the CPU]: inside `compile_scope(model)` inductor's buffer reuse is off for a
    model on the CPU, on for one elsewhere (here the meta device), and as it was after the block."""
    import simplefsdp
    from simplefsdp.passes.install import compile_scope

    assert inductor_config.allow_buffer_reuse
    on_cpu = simplefsdp.wrap(torch.nn.Linear(8, 8))
    with torch.device("meta"):
        on_meta = simplefsdp.wrap(torch.nn.Linear(8, 8))
    with compile_scope(on_cpu):
        assert not inductor_config.allow_buffer_reuse
    assert inductor_config.allow_buffer_reuse
    with compile_scope(on_meta):
        assert inductor_config.allow_buffer_reuse


def test_compile_options_override_the_cpu_buffer_reuse_setting(fake_world8):
    """`torch.compile(model, options={"allow_buffer_reuse": ...})` wins over [Note: no buffer reuse on
    the CPU]: what bench/scoreboard.py relies on to compile every row with one setting. The generated
    code marks each reused buffer `# reuse`."""
    import simplefsdp

    def generated(options):
        torch.compiler.reset()  # Dynamo would reuse the first model's frame for the second
        torch.manual_seed(0)
        model = simplefsdp.wrap(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]))
        compiled = torch.compile(model, options=options)
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            _, code = run_and_get_code(lambda: compiled(torch.randn(4, 16)).sum().backward())
        return "\n".join(code)

    assert "# reuse" not in generated(None)
    assert "# reuse" in generated({"allow_buffer_reuse": True})
