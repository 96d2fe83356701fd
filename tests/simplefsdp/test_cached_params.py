"""Modules that keep references to their parameters: RNNs are handled, anything else is named in a
warning (`simplefsdp/cached_params.py`). On the fake process group (world 8): structure only."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import simplefsdp
from simplefsdp import parametrize
from simplefsdp.parametrize import sharded_parameters
from tests.simplefsdp import _zoo

LOGGER = "simplefsdp.cached_params"


@pytest.fixture
def mesh(fake_world8):
    return init_device_mesh("cpu", (fake_world8,))


class KeepsAList(nn.Module):
    """Reads its weight through a list it built at init: stale after wrapping."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.cache = [self.linear.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.cache[0]


def test_rnn_weights_are_read_by_name_and_the_originals_freed(mesh):
    model = _zoo.Recurrent()
    original = weakref.ref(model.lstm.weight_ih_l0)
    shapes = [tuple(w.shape) for w in model.lstm._flat_weights]
    simplefsdp.wrap(model, mesh)
    gc.collect()
    assert original() is None, "nothing may keep the unsharded weight alive"
    assert [tuple(w.shape) for w in model.lstm._flat_weights] == shapes, "gathered, full shapes"
    assert not any(isinstance(w, DTensor) for w in model.lstm._flat_weights)
    assert not hasattr(model.lstm, "_simplefsdp_gathered_flat_weights"), "nothing gathered is kept"
    gathers = []
    with pytest.MonkeyPatch.context() as patch:  # RNNBase._apply re-initialises its list: no gather
        patch.setattr(parametrize, "gather_full", lambda *args: gathers.append(args))
        model.to_empty(device="cpu")
    assert gathers == []
    assert all(isinstance(w, DTensor) for w in vars(model.lstm)["_flat_weights"])
    with sharded_parameters(model):  # the user's class reads its own list: the sharded parameters
        assert all(isinstance(w, DTensor) for w in model.lstm._flat_weights)
        assert model.lstm._flat_weights[0] is model.lstm.weight_ih_l0
        model.lstm.reset_parameters()


def test_eager_rnns_are_named_in_one_warning(mesh, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        simplefsdp.wrap(_zoo.Recurrent(), mesh)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1
    assert "lstm (LSTM), gru (GRU) run eagerly inside torch.compile" in records[0].getMessage()
    assert "nn.LSTMCell / nn.GRUCell" in records[0].getMessage()


def test_other_cached_references_are_named(mesh, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        simplefsdp.wrap(KeepsAList(), mesh)
        simplefsdp.wrap(_zoo.ResNet(), mesh)  # keeps nothing: no warning
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 1
    assert "KeepsAList keeps references to its parameters in module attributes (<root>.cache)" in messages[0]
