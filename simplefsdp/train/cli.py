"""`simplefsdp train`: parse the flags and config file, launch the ranks, print the summary.

    simplefsdp train                                   # 2 CPU ranks (gloo), or one per GPU (nccl)
    simplefsdp train --config run.toml --steps 500     # flags override the file
    simplefsdp train --resume                          # continue from the newest checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 ... -m simplefsdp.train   # the ranks torchrun starts

Exit codes: 0 done, or nothing to do (--resume from a checkpoint at or past --steps: one line on
stderr says so); 2 a bad flag, config file or setting (one line on stderr, no traceback); 1 a rank
failed while training (its traceback on stderr).
The help and a bad flag answer before torch is imported (`config.py` needs none; the ranks
and the launcher are imported once the flags parse).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from simplefsdp.train.config import ConfigError, TrainConfig, build_parser, parse_args

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        build_parser().print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(parse_args(args))
    except ConfigError as err:
        print(f"simplefsdp train: error: {err}", file=sys.stderr)
        return 2


def _run(config: TrainConfig) -> int:
    """Launch the ranks and print the summary; torch is imported here, once the flags have parsed."""
    from simplefsdp.ranks import RankFailedError, gets_the_result, setup_rank_logging
    from simplefsdp.train.launch import LOGGERS, launch, nothing_to_train

    setup_rank_logging(loggers=LOGGERS, verbose=config.verbose)  # a torchrun rank: as spawned ones
    done = nothing_to_train(config)
    if done is not None:
        if gets_the_result():  # under torchrun every rank finds it: rank 0 says so
            print(f"simplefsdp train: {done}", file=sys.stderr)
        return 0
    try:
        outcome = launch(config)
    except RankFailedError as err:
        print(f"simplefsdp train: {err}", file=sys.stderr)
        return 1
    if outcome is not None:
        rate = f"{outcome.tokens_per_s:,.0f} tokens/s (median)" if outcome.tokens_per_s else "no timed steps"
        first, last = (f"{outcome.losses[0]:.4f}", f"{outcome.losses[-1]:.4f}") if outcome.losses else ("-", "-")
        done = f"trained steps {outcome.start_step + 1}-{outcome.end_step}: loss {first} -> {last}, {rate}"
        if outcome.skipped_steps:
            done += f" ({outcome.skipped_steps} skipped by float16 loss scaling: an inf or nan in the gradients)"
        if outcome.eval_loss is not None:
            done += f", held-out loss {outcome.eval_loss:.4f}"
        if outcome.end_step <= outcome.start_step:
            done = f"no steps to train (at step {outcome.start_step} of {config.steps})"
        exported = f"; full weights in {config.export_dir}" if config.export_dir else ""
        where = f"checkpoints in {config.checkpoint_dir}, run folder {config.run_path}{exported}"
        print(f"{done}; {where}", file=sys.stderr)
    return 0
