"""A training job for the fault tests, launched by torchrun or as plain processes (env:// rendezvous).

    torchrun --nproc-per-node 2 --max-restarts 1 --standalone -m tests.simplefsdp._ckpt_worker \\
        --root CKPT --out OUT --steps 5 --fault 1:3:KILL:mid_step

Trains `_ckpt.train` with a checkpoint after every step. `--fault RANK:STEP:KILL|STOP:WHERE` is
injected on the first attempt only (`TORCHELASTIC_RESTART_COUNT` 0 or unset), so a restarted job
runs clean and resumes from the newest complete checkpoint. After training, rank 0 writes
`OUT/resumed.safetensors` (the final parameters), `OUT/uninterrupted.safetensors` (the same job
without checkpoints or faults, in the same processes) and `OUT/result.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

import safetensors.torch
import torch.distributed as dist

from tests.simplefsdp import _ckpt as ckpt


def _fault(text: str | None) -> ckpt.Fault | None:
    if text is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    rank, step, name, where = text.split(":")
    return ckpt.Fault(int(rank), int(step), {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[name], where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategy", default="FULL_SHARD")
    parser.add_argument("--fault", default=None)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="process group and checkpoint timeout")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    run = ckpt.train(args.root, strategy=args.strategy, steps=args.steps, fault=_fault(args.fault), timeout=timeout)
    reference = ckpt.train(None, strategy=args.strategy, steps=args.steps)
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(run.params, out / "resumed.safetensors")
        safetensors.torch.save_file(reference.params, out / "uninterrupted.safetensors")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        (out / "result.json").write_text(json.dumps({"restarts": restarts, "start_step": run.start_step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
