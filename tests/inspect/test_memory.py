"""`inspect/memory.py`: which inputs of a compiled graph are parameter shards (counted as persistent
memory once, not again by the liveness walk)."""

from __future__ import annotations

import torch
from torch import fx, nn

from simplefsdp.inspect.memory import _parameter_inputs


def _placeholder(graph: fx.Graph, name: str, val: object) -> None:
    graph.placeholder(name).meta["val"] = val


def test_parameter_inputs_are_matched_by_shard_not_by_position():
    """[Note: finding the parameter inputs]: inductor's forward puts buffers and user inputs first
    and an opaque object after every parameter; every parameter is found, nothing else."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))  # weights (4, 8), (2, 4); biases (4,), (2,)
    graph = fx.Graph()
    _placeholder(graph, "primals_1", torch.empty(16, 3))  # a buffer
    _placeholder(graph, "primals_2", torch.empty(5, 8, dtype=torch.long))  # the user's input
    for i, param in enumerate(model.parameters()):
        _placeholder(graph, f"primals_{3 + 2 * i}", torch.empty_like(param))
        _placeholder(graph, f"primals_{4 + 2 * i}", object())  # not a tensor
    graph.output(None)
    assert _parameter_inputs(graph, model) == {"primals_3", "primals_5", "primals_7", "primals_9"}
    # the old rule, the first len(parameters) placeholders, took the buffer, the input and one weight
    first = [n.name for n in graph.find_nodes(op="placeholder")][: len(list(model.parameters()))]
    assert set(first) != _parameter_inputs(graph, model)


def test_an_input_shaped_like_a_shard_takes_one_slot_only():
    model = nn.Linear(3, 3, bias=False)
    graph = fx.Graph()
    _placeholder(graph, "primals_1", torch.empty(3, 3))  # an input shaped like the weight, ahead of it
    _placeholder(graph, "primals_2", torch.empty(3, 3))
    graph.output(None)
    assert _parameter_inputs(graph, model) == {"primals_1"}, "each shard is matched once"
