"""`Workers`: run picklable tasks in this process or in worker processes, each in a fake world.

    with Workers(jobs=2, world_size=1024) as workers:
        results = workers.map(task, [(a,), (b,)], label=str)   # in the order given

[Note: worker processes]
Tracing is single-threaded Python (Dynamo and AOTAutograd), so tasks trace in parallel only in
separate processes: each worker (spawned, so no state of this process leaks in) joins its own fake
world of `world_size` ranks once and runs whole tasks. A task's result must depend only on its
arguments (then the answer is the same with any number of workers) and be picklable and small:
graphs stay in the worker. With `jobs=1` the tasks run here, inside one fake world held for the
block, and need not be picklable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from simplefsdp._compat import init_fake_process_group
from simplefsdp.inspect.dryrun import fake_world

__all__ = ["Workers"]


def _start_worker(world_size: int) -> None:
    init_fake_process_group(rank=0, world_size=world_size)


class Workers:
    """Tasks over `jobs` worker processes (1: this process); `on_progress(message)` after each task."""

    def __init__(self, *, jobs: int, world_size: int, on_progress: Callable[[str], None] | None = None) -> None:
        if not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
        self._jobs, self._world_size, self._on_progress = jobs, world_size, on_progress
        self._stack = contextlib.ExitStack()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> Workers:
        if self._jobs == 1:
            self._stack.enter_context(fake_world(self._world_size))
        else:
            self._pool = self._stack.enter_context(
                concurrent.futures.ProcessPoolExecutor(
                    max_workers=self._jobs,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(self._world_size,),
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _progress(self, done: int, total: int, what: str) -> None:
        if self._on_progress is not None:
            self._on_progress(f"[{done}/{total}] {what}")

    def map(self, task: Callable[..., Any], calls: Sequence[tuple], *, label: Callable[..., str]) -> list[Any]:
        """`task(*call)` for each call, results in `calls`' order; `label(*call)` names a call in
        progress messages. A task's failure is raised here, with the worker's traceback."""
        if self._pool is None:
            results = []
            for call in calls:
                results.append(task(*call))
                self._progress(len(results), len(calls), label(*call))
            return results
        futures = {self._pool.submit(task, *call): call for call in calls}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            future.result()
            self._progress(done, len(calls), label(*futures[future]))
        return [future.result() for future in futures]
