"""wrap() without an initialised process group: a clear error, not a hang or a crash inside torch."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import simplefsdp


def test_no_process_group():
    assert not dist.is_initialized(), "precondition: no other test leaves a process group behind"
    with pytest.raises(RuntimeError, match=r"needs a process group: call torch.distributed.init_process_group"):
        simplefsdp.wrap(nn.Linear(2, 2))
