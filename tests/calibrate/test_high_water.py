"""The two peak-memory measurements: tensor bytes from torch's allocator, resident bytes from the kernel."""

from __future__ import annotations

import threading

import torch

from simplefsdp._compat import counting_cpu_allocations_on_every_thread
from simplefsdp.calibrate.high_water import (
    count_cpu_allocations_on_every_thread,
    high_water_bytes,
    tensor_high_water_bytes,
)

CPU = torch.device("cpu")
MiB = 1 << 20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_tensor_peak_is_the_most_bytes_live_at_once():
    def call() -> None:
        a, b = _bytes(4 * MiB), _bytes(2 * MiB)
        del a
        c = _bytes(1 * MiB)
        del b, c

    assert tensor_high_water_bytes(call, CPU) == 6 * MiB


def test_tensor_peak_is_measured_from_what_was_held_at_the_start():
    with count_cpu_allocations_on_every_thread():  # the allocator counts what lives between the calls
        held = [_bytes(4 * MiB)]

        def call(then: int) -> None:
            held.clear()  # 4 MiB held before the call, freed in it
            _bytes(then * MiB)

        assert tensor_high_water_bytes(lambda: call(3), CPU) == 0  # never above the start
        held.append(_bytes(4 * MiB))
        assert tensor_high_water_bytes(lambda: call(6), CPU) == 2 * MiB


def test_the_allocator_accounting_is_on_for_the_call_only():
    """The libc10 flag `tensor_high_water_bytes` turns on is as it was after the call, and after a block."""
    assert not counting_cpu_allocations_on_every_thread()
    tensor_high_water_bytes(lambda: _bytes(MiB), CPU)
    assert not counting_cpu_allocations_on_every_thread()
    with count_cpu_allocations_on_every_thread():
        tensor_high_water_bytes(lambda: _bytes(MiB), CPU)
        assert counting_cpu_allocations_on_every_thread(), "an enclosing block keeps it on"
    assert not counting_cpu_allocations_on_every_thread()


def test_tensor_peak_sees_the_buffers_of_inductor_code():
    n = 512  # the matmul's [n, n] output is a buffer inductor's generated code allocates

    @torch.compile(backend="inductor")
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x @ x).relu().sum()

    x = torch.randn(n, n)
    f(x)  # compile outside the measurement
    peak = tensor_high_water_bytes(lambda: f(x), CPU)
    assert n * n * 4 <= peak <= 2 * n * n * 4


def test_resident_peak_counts_touched_pages():
    def call() -> None:
        _bytes(32 * MiB).fill_(1)  # written: resident

    assert high_water_bytes(call, CPU) >= 30 * MiB


def test_tensor_peak_counts_what_other_threads_free_and_hold():
    held: list[torch.Tensor] = []

    def call() -> None:
        held.append(_bytes(2 * MiB))
        freer = threading.Thread(target=held.clear)  # frees the 2 MiB on another thread
        freer.start()
        freer.join()
        maker = threading.Thread(target=lambda: held.append(_bytes(4 * MiB)))
        maker.start()
        maker.join()
        a = _bytes(1 * MiB)  # 4 MiB held elsewhere + 1 MiB here: the peak
        del a
        held.clear()

    assert tensor_high_water_bytes(call, CPU) == 5 * MiB
