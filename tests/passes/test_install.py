"""The pass chain `install.py` builds around a user's own post-grad pass (no compiling here)."""

from __future__ import annotations

import dataclasses

from torch import fx

from simplefsdp._compat import CustomGraphPass, CustomInferenceAwareGraphPass
from simplefsdp.passes.fsdp_pass import FsdpPass
from simplefsdp.passes.install import ChainedPass, chained_with


class _Named(CustomGraphPass):
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __call__(self, graph: fx.Graph) -> None:
        self.log.append(self.name)

    def uuid(self) -> str:
        return self.name


class _Aware(CustomInferenceAwareGraphPass):
    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, graph: fx.Graph, is_inference: bool) -> None:
        self.log.append(("aware", is_inference))

    def uuid(self) -> str:
        return "aware"


def test_ours_runs_first_then_the_users():
    log, ours = [], FsdpPass()
    chain = chained_with(ours, _Named("user", log))
    assert isinstance(chain, ChainedPass)
    assert chain.passes[0] is ours
    chain(fx.Graph())
    assert log == ["user"]
    assert ours.graphs == 1
    assert chained_with(ours, None) is ours, "alone when the user set nothing"
    assert chained_with(ours, chain) is chain, "not installed twice"


def test_chain_cache_key():
    log, ours = [], FsdpPass()
    keyed = chained_with(ours, _Named("user", log))
    assert keyed.uuid()
    assert keyed.uuid() != chained_with(ours, _Named("other", log)).uuid()
    assert chained_with(ours, lambda graph: None).uuid() is None, "a plain callable cannot key the cache"


def test_inference_flag_reaches_aware_passes():
    log = []
    chain = chained_with(FsdpPass(), [_Aware(log), _Named("plain", log)])
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


def test_pass_cache_key_is_its_configuration():
    """The `uuid()` that keys inductor's caches depends on the configuration, groups and rank only:
    equal in two fresh processes (no ids, no hash seeds), different when the pass would do something
    else (the rank's part is tested in test_rank_independence.py)."""
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
