"""`LiveTensorBytes`: counts storages created inside the block, once, from creation to free."""

from __future__ import annotations

import torch

from simplefsdp.inspect.live_bytes import LiveTensorBytes

MIB = 2**20


def test_peak_and_live_bytes_of_known_allocations():
    before = torch.ones(MIB // 4)  # 1 MiB created outside: never counted, even when used inside
    with LiveTensorBytes() as live:
        a = torch.empty(MIB // 4)  # 1 MiB
        b = torch.empty(MIB // 2)  # 2 MiB -> 3 live
        view = b.view(2, -1)  # a view: no new bytes
        b.add_(1)  # in place: no new bytes
        detached = before.detach()  # aliases a storage from outside: no new bytes
        before.mul_(2)
        del a  # -> 2 live
        c = b + 1  # 2 MiB -> 4 live: the peak
        assert live.live_bytes == 4 * MIB
        del b, view, c
        assert live.live_bytes == 0
    assert live.peak_bytes == 4 * MIB
    assert detached.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()


def test_compiled_code_runs_under_it_and_is_measured():
    """Dynamo compiles through the mode (it declares itself infrastructure) and the op-by-op graph's
    buffers are counted: a compiled x * 2 + 1 on 1 MiB allocates at least its 1 MiB output."""
    fn = torch.compile(lambda x: (x * 2 + 1).sum(dim=0), backend="aot_eager", fullgraph=True)
    x = torch.ones(MIB // 4, 1)
    fn(x)  # compile outside the block
    with LiveTensorBytes() as live:
        out = fn(x)
    assert live.peak_bytes >= MIB
    assert out.item() == 3 * (MIB // 4)
