"""How long the `simplefsdp` command takes to answer its help and a bad flag, and whether it imported torch.

    python bench/startup.py                 # each command 5 times, warm (after one unmeasured run)
    python bench/startup.py --repeats 10

Each command runs in a fresh interpreter (`python -m simplefsdp.cli ...`, what the console script
runs); the table gives the median and fastest wall time and whether `torch` was in `sys.modules` at
exit. The machine's load average is printed with it: on a shared machine the times follow the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

COMMANDS = (
    ("--help",),
    ("train", "--help"),
    ("train", "--steps", "x"),
    ("train", "--strategy", "BOGUS"),
    ("calibrate", "--help"),
    ("inspect", "--help"),
)

# runs one command as the console script does, then reports whether torch was imported
_RUN = """
import sys
import simplefsdp.cli
try:
    code = simplefsdp.cli.main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _run(command: tuple[str, ...]) -> tuple[float, bool]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _RUN, *command], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    return seconds, done.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="measured runs per command (default 5)")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| command | median | fastest | imports torch |")
    print("|---|---|---|---|")
    for command in COMMANDS:
        _run(command)  # warm: the files in the page cache, as for a command run a second time
        runs = [_run(command) for _ in range(args.repeats)]
        times = [seconds for seconds, _ in runs]
        torch_imported = "yes" if runs[-1][1] else "no"
        label = " ".join(("simplefsdp", *command))
        print(f"| `{label}` | {statistics.median(times):.2f} s | {min(times):.2f} s | {torch_imported} |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
