"""A joint-graph pass: a region's backward reads the inputs its forward returned unchanged from the
inputs themselves, so resharding after forward still re-gathers in backward.

[Note: a region must not save the gathered weights]
A block compiled as a nested region (`simplefsdp/regions.py`) receives its gathered parameters as
inputs. AOTAutograd partitions the region's own forward and backward first; whatever the body's
backward needs from its forward -- the gathered weights among them -- the forward body returns as
extra outputs. In the joint graph the backward call then reads the weights as outputs of the forward
call, and the step's partitioner cannot recompute an output of a call: it saves them, and the
gathered weights stay alive from forward to backward (ZeRO-2's memory under FULL_SHARD; measured:
without this pass a 3-block model's backward re-gathered only the two weights outside the blocks).

An output that is one of the body's inputs, returned as it is, is that input. This pass points
each use of such an output at the call's input instead. The gathered weight is then what the
backward call reads directly, and it was made by the gather the resharding checkpoint tags for
recomputation: the partitioner saves the shard and re-gathers in backward, as without regions.
The values are the same tensors, so results are bitwise unchanged; the forward body still returns
the input (an alias: no copy).
"""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import torch
from torch import fx

from simplefsdp._compat import CustomGraphPass, OpOverload

__all__ = ["BODY_KEY", "ForwardRegionInputs", "forward_region_inputs", "note_region_bodies"]

BODY_KEY = "simplefsdp_region_body"  # node.meta key: the body (a GraphModule) an invoke_subgraph node calls


def forward_region_inputs(graph: fx.Graph) -> int:
    """Point every use of an invoke_subgraph output that is one of its body's inputs -- as it is, or
    through view ops only (a transposed weight) -- at that input (the views rebuilt in `graph`);
    returns how many outputs were replaced."""
    moved = 0
    owner = graph.owning_module
    for call in graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        body = getattr(owner, call.args[0].target, None)
        if not isinstance(body, fx.GraphModule):
            continue
        inputs = list(body.graph.find_nodes(op="placeholder"))
        (outputs,) = body.graph.find_nodes(op="output")[0].args
        for user in list(call.users):
            if user.target is not operator.getitem:
                continue
            views = _views_of_input(outputs[user.args[1]], inputs)
            source = None if views is None else call.args[2 + inputs.index(views[0])]
            if not isinstance(source, fx.Node):
                continue
            with graph.inserting_before(user):
                for view in views[1:]:  # the same view ops, applied to the call's operand
                    value = view.target(source.meta["val"], *view.args[1:], **view.kwargs)
                    source = graph.call_function(view.target, (source, *view.args[1:]), dict(view.kwargs))
                    source.meta["val"] = value
            user.replace_all_uses_with(source, propagate_meta=False)
            moved += 1
    return moved


def _views_of_input(node: object, inputs: list[fx.Node]) -> list[fx.Node] | None:
    """[input, view, view, ...] when `node` is an input of the body or views of one (each a view
    op whose only tensor argument is the previous node); None otherwise."""
    chain = []
    while isinstance(node, fx.Node) and node not in inputs:
        if not (isinstance(node.target, OpOverload) and node.target.is_view and len(node.all_input_nodes) == 1):
            return None
        if node.args[0] is not node.all_input_nodes[0]:
            return None
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    return [node, *reversed(chain)]


def note_region_bodies(graph: fx.Graph) -> None:
    """Give each invoke_subgraph node of `graph` its body under `node.meta[BODY_KEY]`, so that what
    reads a copy of the graph (a recording has no owning module) can still see what the call
    computes: the cost model prices a call as its body (`cost.node_seconds`)."""
    owner = graph.owning_module
    for call in graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        body = getattr(owner, call.args[0].target, None) if owner is not None else None
        if isinstance(body, fx.GraphModule):
            call.meta[BODY_KEY] = body


class ForwardRegionInputs(CustomGraphPass):
    """`forward_region_inputs` as inductor's `joint_custom_pre_pass` (its uuid: this file's source)."""

    def __call__(self, graph: fx.Graph) -> None:
        forward_region_inputs(graph)

    def uuid(self) -> str:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
