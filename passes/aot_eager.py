"""`torch.compile(model, backend="simplefsdp_aot_eager")`: aot_eager plus the post-grad custom pass.

For debugging a wrapped model without inductor: the forward and backward graphs are partitioned
as inductor would (min-cut, so resharding recomputes the gathers), then the post-grad passes
inductor would run -- a wrapped model's own pass while it is being compiled, chained with the
user's, see `install.installed` -- run on them, and they execute
eagerly op by op. The graphs are not decomposed as inductor's are (casts stay `_to_copy`);
simplefsdp's pass handles both forms.
"""

from __future__ import annotations

from functorch.compile import make_boxed_func
from torch import fx

from simplefsdp._compat import (
    BoxedCodeGen,
    aot_autograd,
    inductor_config,
    min_cut_rematerialization_partition,
    register_backend,
)
from simplefsdp.passes.install import ChainedPass, configured_passes, installed

__all__ = ["BACKEND_NAME", "backend"]

BACKEND_NAME = "simplefsdp_aot_eager"


def _run_post_grad_pass(gm: fx.GraphModule, example_inputs):
    """The graph after the configured passes, as a callable taking its inputs boxed (in one list
    that it frees as it goes), the calling convention AOTAutograd expects.

    [Note: inputs freed at their last use]
    The generated code takes the list and clears it, and FX's code drops each value after its last
    use, so a backward frees each saved activation as soon as it is consumed -- as inductor's code
    does, so a step's memory here is comparable to inductor's (with plain `make_boxed_func`, the
    caller's list would keep every input alive until the graph returns)."""
    ChainedPass(installed())(gm.graph)
    gm.graph.lint()
    if BoxedCodeGen is None:
        gm.recompile()
        return make_boxed_func(gm)
    gm.graph.set_codegen(BoxedCodeGen())
    gm.recompile()

    def boxed(args: list) -> object:
        return gm(args)

    boxed._boxed_call = True
    return boxed


def _partition(joint: fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partition: the configured joint-graph passes (`joint_custom_pre_pass`, e.g. a
    wrapped model's `ForwardRegionInputs`), then the min-cut partitioner."""
    for graph_pass in configured_passes(inductor_config.joint_custom_pre_pass):
        graph_pass(joint.graph)
    joint.recompile()
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def backend(gm: fx.GraphModule, example_inputs):
    compile_graphs = aot_autograd(
        fw_compiler=_run_post_grad_pass,
        bw_compiler=_run_post_grad_pass,
        partition_fn=_partition,
    )
    return compile_graphs(gm, example_inputs)


register_backend(name=BACKEND_NAME, compiler_fn=backend)
