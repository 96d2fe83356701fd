"""The `simplefsdp` command: a small dispatcher over subcommands, each owned by its own module.

    simplefsdp inspect MODEL [options]     # simplefsdp/inspect/cli.py
    simplefsdp train [options]             # simplefsdp/train/cli.py
    simplefsdp precompile [train options]  # simplefsdp/train/precompile.py
    simplefsdp calibrate [options]         # simplefsdp/calibrate/cli.py

A subcommand module provides `main(argv) -> int`; add one with an entry in `_SUBCOMMANDS`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

_SUBCOMMANDS = {
    "inspect": ("simplefsdp.inspect.cli", "dry-run a model: buckets, schedule, memory, timeline pictures"),
    "train": ("simplefsdp.train.cli", "train a Llama-style model (2 CPU ranks by default, or torchrun's)"),
    "precompile": ("simplefsdp.train.precompile", "compile a train job ahead of its ranks, into its compile cache"),
    "calibrate": ("simplefsdp.calibrate.cli", "measure this machine and write a cost-model profile file"),
}


def _usage() -> str:
    lines = ["usage: simplefsdp <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)  # no command: an error, on stderr
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in _SUBCOMMANDS:
        print(f"simplefsdp: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
