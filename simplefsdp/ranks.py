"""Run a function on every rank of a job: the ranks of this process's group, torchrun's, or spawned ones.

    result = run_on_ranks(functools.partial(work, settings), nproc=None, device_type="cpu")

Where the ranks come from, first match:
- this process is already in a default process group (a script that set one up, under torchrun or
  another launcher): it is one rank, and runs the function on that group, which stays as it was;
- under torchrun (RANK, WORLD_SIZE and LOCAL_RANK set) this process is one rank: it joins the group
  torchrun describes (env:// rendezvous) for the call and leaves it after;
- otherwise it spawns `nproc` ranks (default: 2 on the CPU, one per GPU), joined through a file in a
  temporary directory.
CUDA ranks use NCCL and one GPU each (`cuda:LOCAL_RANK`; in an existing group, the current device);
CPU ranks use gloo. `simplefsdp train` and `simplefsdp calibrate` start their ranks here.

The calling process's logging, warning filters and process group are left as they were: only
spawned ranks (processes of this module's own) configure theirs ([Note: one rank speaks]). A
command-line entry point that wants the same for a torchrun rank calls `setup_rank_logging` itself.

[Note: compile threads when spawning on the CPU]
Every spawned rank compiles its own graphs; by default inductor starts a pool of compile workers
per process sized to the machine, so N ranks on a small machine fight N pools for its cores.
Spawned CPU ranks get `TORCHINDUCTOR_COMPILE_THREADS=1` and an equal share of the cores for
intra-op threads, unless the environment already sets the variable, and keep the memory they free
for their next step ([Note: freed memory kept on the CPU] in `cpu_memory.py`). Under torchrun the
user's environment is left as it is.

[Note: a rank that dies after finishing]
Every rank reports that it finished before its process group is torn down, so that a rank that
then dies (a signal, or a non-zero exit in the teardown) is still told apart from one that died in
its work. Either is a failure: a crash means the process was not sound -- a heap corrupted by a
race, as torch's two gloo workers can do ([Note: torch's two gloo workers race] in `gloo.py`), is
noticed by glibc at some later free -- so the results it reported are not trusted.
`RankFailedError` names the rank, how it ended and that it had reported its result.

[Note: one rank speaks]
Every rank runs the same code and meets the same warnings; N copies of each, interleaved through
rank 0's progress bar, bury the one line that differs. So ranks other than 0 show errors only --
Python warnings ignored, their loggers and torch's at ERROR -- unless `verbose=True`. A failing
rank still reports: its traceback travels back to the launcher (`RankFailedError`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simplefsdp import gloo
from simplefsdp._compat import set_torch_logs
from simplefsdp.cpu_memory import keep_freed_memory

__all__ = [
    "RankFailedError",
    "gets_the_result",
    "run_on_ranks",
    "setup_rank_logging",
    "spawn_world",
    "spawned_rank_threads",
    "under_torchrun",
]

logger = logging.getLogger(__name__)

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SPAWN_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}

RankFunction = Callable[[torch.device], Any]


class RankFailedError(RuntimeError):
    """A spawned rank raised; the message holds its error and traceback."""


def under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_ENV)


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _run(
    function: RankFunction,
    device_type: str,
    local_rank: int,
    *,
    finished: Callable[[Any], None] | None = None,
    **init: object,
) -> Any:
    """`function(device)` inside a process group; `finished(result)` runs before the group is torn down."""
    device = _device(device_type, local_rank)
    init = {k: v for k, v in init.items() if v is not None}
    dist.init_process_group("nccl" if device.type == "cuda" else gloo.backend(), **init)
    try:
        result = function(device)
        if finished is not None:
            finished(result)
        return result
    finally:
        dist.destroy_process_group()


def setup_rank_logging(*, loggers: tuple[str, ...] = (), verbose: bool = False) -> None:
    """For a command-line entry point: when this process is a torchrun rank, configure its logging as a
    spawned rank's ([Note: one rank speaks]); otherwise do nothing (spawned ranks configure their own).
    Library functions never call it."""
    if under_torchrun():
        _setup_logging(int(os.environ["RANK"]), loggers, verbose=verbose)


def gets_the_result() -> bool:
    """Whether `run_on_ranks` called here returns rank 0's result (not None): rank 0 of this process's
    group or of a torchrun job, or a process that spawns its ranks. Where a command writes its output."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    if under_torchrun():
        return int(os.environ["RANK"]) == 0
    return True


def _run_here(function: RankFunction, device_type: str) -> Any:
    """`function(device)` on the default group this process is already in (left as it is)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    result = function(device)
    return result if dist.get_rank() == 0 else None


def _setup_logging(rank: int, loggers: tuple[str, ...], *, verbose: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    if rank == 0:
        for name in loggers:
            logging.getLogger(name).setLevel(logging.INFO)
    elif not verbose:  # [Note: one rank speaks]
        logging.getLogger().setLevel(logging.ERROR)
        set_torch_logs(all=logging.ERROR)
        warnings.simplefilter("ignore")


def _spawned(
    rank: int,
    world: int,
    init_file: str,
    function: RankFunction,
    device_type: str,
    passthrough: tuple[type[BaseException], ...],
    loggers: tuple[str, ...],
    verbose: bool,
    timeout: datetime.timedelta | None,
    results: mp.Queue,
) -> None:
    _setup_logging(rank, loggers, verbose=verbose)
    if device_type == "cpu":
        torch.set_num_threads(spawned_rank_threads(world))
        keep_freed_memory()  # [Note: freed memory kept on the CPU] in `cpu_memory.py`

    reported = False

    def finished(result: Any) -> None:  # every rank reports; only rank 0's result travels
        nonlocal reported
        results.put((rank, result if rank == 0 else None, None))
        results.close()
        results.join_thread()  # in the pipe before the teardown, which may kill this process
        reported = True

    try:
        init = {"init_method": f"file://{init_file}", "rank": rank, "world_size": world, "timeout": timeout}
        _run(function, device_type, rank, finished=finished, **init)
    except BaseException as err:
        if not reported:  # an error in the teardown itself travels as the process's exception
            results.put((rank, err if isinstance(err, passthrough) else None, traceback.format_exc()))
        raise


@contextlib.contextmanager
def _spawn_env(device_type: str) -> Iterator[None]:
    """See [Note: compile threads when spawning on the CPU]."""
    added = {k: v for k, v in _SPAWN_ENV.items() if k not in os.environ} if device_type == "cpu" else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _reports(results: mp.Queue) -> list[tuple[int, object, str | None]]:
    """What the ranks put: `(rank, result or None, None)` when finished, `(rank, error or None,
    traceback)` when failed."""
    reports = []
    with contextlib.suppress(queue.Empty):
        while True:
            reports.append(results.get(timeout=1.0))
    return reports


def spawned_rank_threads(world: int) -> int:
    """The intra-op threads of each of `world` CPU ranks spawned here: an equal share of the cores."""
    return max(1, (os.cpu_count() or world) // world)


def spawn_world(nproc: int | None, device_type: str) -> int:
    """How many ranks `run_on_ranks` spawns for `nproc` (None: 2 on the CPU, every GPU on CUDA)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device is available")
    return nproc or (torch.cuda.device_count() if device_type == "cuda" else 2)


def run_on_ranks(
    function: RankFunction,
    *,
    nproc: int | None,
    device_type: str,
    passthrough: tuple[type[BaseException], ...] = (),
    loggers: tuple[str, ...] = (),
    verbose: bool = False,
    timeout: datetime.timedelta | None = None,
) -> Any:
    """`function(device)` on every rank, inside an initialised default process group; returns rank
    0's result (None on the other ranks when this process is one of them). Where the ranks come
    from: the module docstring.

    `function` must be picklable (a module-level function or a `functools.partial` of one). A
    spawned rank's exception of a `passthrough` type is raised here as it is; any other becomes a
    `RankFailedError` holding the lowest failing rank's traceback, as does a spawned rank that
    crashed ([Note: a rank that dies after finishing]). On spawned ranks, `loggers` log at INFO on
    rank 0 and the other ranks show errors only unless `verbose` ([Note: one rank speaks]).
    `nproc` applies to spawned ranks only; `timeout` (how long a collective may wait for the other
    ranks before it fails; default: the process group's, 30 minutes) to a group made here.
    """
    if dist.is_initialized():
        return _run_here(function, device_type)
    if under_torchrun():
        rank = int(os.environ["RANK"])
        result = _run(function, device_type, int(os.environ["LOCAL_RANK"]), timeout=timeout)
        return result if rank == 0 else None
    world = spawn_world(nproc, device_type)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    logger.info("spawning %d ranks (%s)", world, "nccl" if device_type == "cuda" else "gloo")
    with tempfile.TemporaryDirectory(prefix="simplefsdp-ranks-") as tmp, _spawn_env(device_type):
        args = (world, os.path.join(tmp, "pg"), function, device_type, passthrough, loggers, verbose, timeout, results)
        try:
            mp.start_processes(_spawned, args=args, nprocs=world, start_method="spawn")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
            _after_failure(err, _reports(results))
    return _rank0_result([results.get(timeout=60) for _ in range(world)])


def _rank0_result(reports: list[tuple[int, object, str | None]]) -> Any:
    for rank, value, text in reports:
        if rank == 0 and text is None:
            return value
    raise RankFailedError("rank 0 finished but its result did not arrive")


def _after_failure(err: BaseException, reports: list[tuple[int, object, str | None]]) -> NoReturn:
    """Raise the lowest failing rank's error; a rank that crashed is a failure even when it had
    reported its result first ([Note: a rank that dies after finishing])."""
    failures = sorted((r for r in reports if r[2] is not None), key=lambda r: r[0])
    if failures:
        rank, passed, text = failures[0]
        if passed is not None:
            raise passed from None
        raise RankFailedError(f"rank {rank} failed:\n{text}") from None
    finished = {rank for rank, _, _ in reports}
    crashed = getattr(err, "error_index", None)
    if crashed in finished:
        raise RankFailedError(f"{err}, after it had reported its result: the run's results are not trusted") from None
    raise RankFailedError(str(err)) from None
