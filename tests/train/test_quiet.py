"""What reaches the terminal from `simplefsdp train`'s ranks: one rank's warnings, torch's benign ones
for the built-in model dropped ([Note: one rank speaks], [Note: filtered narrowly]); `--verbose`
shows everything."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from simplefsdp.train.quiet import BENIGN, drop_benign_torch_warnings
from tests._tiers import fast_first

_SPEAK = """
import logging, sys, warnings
from simplefsdp.ranks import _setup_logging
_setup_logging({rank}, (), verbose={verbose})
warnings.warn("a python warning")
logging.getLogger("simplefsdp.x").warning("a simplefsdp warning")
logging.getLogger("torch._dynamo").warning("a torch warning")
logging.getLogger("simplefsdp.x").error("an error")
"""


@pytest.mark.parametrize(("rank", "verbose"), fast_first([(1, False), (0, False), (1, True)], rows=True))
def test_other_ranks_show_errors_only_unless_verbose(rank, verbose):
    run = subprocess.run(
        [sys.executable, "-c", _SPEAK.format(rank=rank, verbose=verbose)], capture_output=True, text=True, check=True
    )
    shown = rank == 0 or verbose
    for text in ("a python warning", "a simplefsdp warning", "a torch warning"):
        assert (text in run.stderr) == shown, run.stderr
    assert "an error" in run.stderr, "errors always show"


def test_benign_torch_warnings_are_dropped_narrowly():
    """Only the listed phrase on the listed logger is dropped; the same logger's other warnings,
    and the phrase on another logger, still show. Installing twice adds no second filter."""
    name, phrase = BENIGN[0]
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name}: {record.getMessage()}")

    handler = Collect()
    loggers = [logging.getLogger(name), logging.getLogger("simplefsdp.elsewhere")]
    for target in loggers:
        target.addHandler(handler)
    try:
        drop_benign_torch_warnings()
        drop_benign_torch_warnings()
        assert len(loggers[0].filters) == 1
        loggers[0].warning("\nDetected that %s.\nPlease make sure ...", phrase)
        loggers[0].warning("something else")
        loggers[1].warning("Detected that %s.", phrase)
    finally:
        for target in loggers:
            target.removeHandler(handler)
        loggers[0].filters.clear()
    assert seen == [f"{name}: something else", f"simplefsdp.elsewhere: Detected that {phrase}."]
