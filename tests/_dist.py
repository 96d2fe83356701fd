"""A pool of gloo ranks spawned once and reused by every test of a session (see tests/conftest.py).

    pool = RankPool(world_size=2)
    per_rank_results = pool.run(some_module_level_function, arg, key=value)

The function runs on every rank at once (inside an initialised default process group) and its
return values come back as a list indexed by rank. It must be importable by name (defined at
module level) and its arguments and results picklable. An exception on any rank is re-raised in
the test with that rank's traceback; a rank that hangs or dies fails the test after `timeout_s`
(default 150 s, inside the suite's 180 s per test) instead of hanging the suite, and the pool is
restarted for the next test -- also when the test's own timeout interrupts the wait.

A rank that dies hard (a segfault, a kill) cannot send its traceback: each rank writes Python's
fault handler output to a log in the pool's own directory, and a failure that names a rank with no
answer also gives that rank's exit code and the end of its log. The directory (the process group's
file store included) is removed when the pool closes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simplefsdp import gloo

__all__ = ["RankPool"]

# Compiles inside spawned ranks: no extra compile worker pool per rank (2 cores for 2-4 ranks).
_WORKER_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}
_COLLECTIVE_TIMEOUT = timedelta(seconds=300)
_FAILURE_GRACE_S = 20.0
# A task's timeout counts the task, not the pool's start: each rank reports `_READY` once it has
# imported torch and joined the group, which on a loaded 2-core machine can take longer than a short
# task's whole budget; the start has its own, generous limit.
_READY = "simplefsdp-rank-ready"
_START_TIMEOUT_S = 300.0


def _fault_log(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.faults")


def _worker(rank: int, world_size: int, directory: str, tasks: mp.Queue, results: mp.Queue) -> None:
    fault_log = open(_fault_log(directory, rank), "w")  # noqa: SIM115 -- open for the process's lifetime
    faulthandler.enable(file=fault_log, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=fault_log, all_threads=True)
    init_file = os.path.join(directory, "store")  # the file store creates it
    torch.set_num_threads(1)
    dist.init_process_group(  # one gloo worker thread: [Note: torch's two gloo workers race]
        gloo.backend(), init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT
    )
    results.put((rank, True, _READY))
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            torch.compiler.reset()  # each test compiles from scratch: no recompile limits carried over
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, *, world_size: int, timeout_s: float = 150.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="simplefsdp-pg-")  # a fresh file store for each start
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        saved = {k: os.environ.get(k) for k in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)
        try:
            self._procs = [
                ctx.Process(
                    target=_worker,
                    args=(rank, self.world_size, self._dir, self._tasks[rank], self._results),
                    daemon=True,
                )
                for rank in range(self.world_size)
            ]
            for proc in self._procs:
                proc.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._await_ready()

    def _await_ready(self) -> None:
        """Wait until every rank has joined the group (`_READY`); a rank that does not within
        `_START_TIMEOUT_S` fails the start, with what is known of it."""
        ready: set[int] = set()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(ready) < self.world_size:
            try:
                rank, _, value = self._results.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - ready)
                message = f"ranks {missing} did not start within {_START_TIMEOUT_S:.0f}s{self._silent_ranks(missing)}"
                self.close(kill=True)
                raise TimeoutError(message) from None
            assert value == _READY, f"rank {rank} answered {value!r} before it reported ready"
            ready.add(rank)

    def _collect(self, fn: Callable[..., Any]) -> dict[int, tuple[bool, Any]]:
        """Each rank's (ok, value) for the task just queued; fewer entries if a rank failed and the
        others did not answer within the grace period."""
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(outcomes) < self.world_size:
            # Once a rank has failed, the others may wait forever on a collective it never joins:
            # give them a short grace period to report, then tear the pool down.
            failed = any(not ok for ok, _ in outcomes.values())
            wait_s = min(deadline - time.monotonic(), _FAILURE_GRACE_S if failed else self.timeout_s)
            try:
                rank, ok, value = self._results.get(timeout=max(wait_s, 0.0))
            except queue.Empty:
                if failed:
                    break
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                raise TimeoutError(
                    f"{fn.__name__} did not finish on ranks {missing} within {self.timeout_s:.0f}s"
                    f"{self._silent_ranks(missing)}"
                ) from None
            outcomes[rank] = (ok, value)
        return outcomes

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if not self._procs:
            self._start()
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        try:
            outcomes = self._collect(fn)
        except BaseException:
            # Interrupted (the test's own timeout, Ctrl-C) or timed out: ranks may be stuck in the
            # task; the next test must not queue behind them.
            self.close(kill=True)
            raise
        failures = {rank: value for rank, (ok, value) in outcomes.items() if not ok}
        if failures:
            details = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
            stuck = sorted(set(range(self.world_size)) - set(outcomes))
            silent = self._silent_ranks(stuck)
            self.close()  # a failed collective can leave the group unusable: start afresh next time
            raise AssertionError(
                f"{fn.__name__} failed on ranks {sorted(failures)} (no answer from {stuck}):\n{details}{silent}"
            )
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _silent_ranks(self, ranks: list[int]) -> str:
        """What is known of ranks that gave no answer: alive or their exit code (negative: the
        signal), and the end of their fault log (a hard crash's Python stacks)."""
        alive = [self._procs[rank] for rank in ranks if self._procs[rank].is_alive()]
        if alive and hasattr(signal, "SIGUSR1"):
            for proc in alive:  # a live rank's stacks, through the handler its worker registered
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
        lines = []
        for rank in ranks:
            proc = self._procs[rank]
            state = "still running" if proc.is_alive() else f"exited with code {proc.exitcode}"
            try:
                with open(_fault_log(self._dir, rank)) as log:
                    tail = log.read()[-4000:].strip()
            except OSError:
                tail = ""
            lines.append(f"--- rank {rank}: {state} ---" + (f"\n{tail}" if tail else ", fault log empty"))
        return "".join(f"\n{line}" for line in lines)

    def close(self, *, kill: bool = False) -> None:
        """Ask every rank to leave (they destroy the group together), then reap; kill any that hang
        (`kill`: all of them at once, for ranks known to be stuck)."""
        for task_queue in self._tasks if self._procs and not kill else []:
            with contextlib.suppress(Exception):
                task_queue.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if kill else 30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._procs:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs = []
