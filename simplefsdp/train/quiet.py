"""What `simplefsdp train` keeps off the terminal unless `--verbose` (and `simplefsdp inspect` for a
named shape): torch's warnings that are known to be benign for the commands' own model.

[Note: filtered narrowly]
Each entry names the logger a warning comes from and a phrase of its message; a record is dropped
only when both match, so any other warning of the same logger still shows. Entries:
- `torch._higher_order_ops.wrap`, "context_fn is passed to torch.utils.checkpoint under
  torch.compile" (`_compat.CHECKPOINT_CONTEXT_FN_WARNING`): torch asks the user to make sure a
  selectively checkpointed region has no in-place ops. The built-in `Transformer`'s blocks have
  none (checked on torch 2.13), so for the train command this is noise, printed by every rank
  through the progress bar; `simplefsdp inspect` traces the same blocks (a named shape; their
  grouped-query attention has no in-place op either) in every configuration with checkpointing.
  For a user's own model, `simplefsdp.checkpoint_blocks` leaves it on: there it is a real question.
"""

from __future__ import annotations

import logging

from simplefsdp._compat import CHECKPOINT_CONTEXT_FN_WARNING

__all__ = ["BENIGN", "drop_benign_torch_warnings"]

BENIGN: tuple[tuple[str, str], ...] = (CHECKPOINT_CONTEXT_FN_WARNING,)


class _DropPhrase(logging.Filter):
    """Drops a record whose message contains `phrase`."""

    def __init__(self, phrase: str) -> None:
        super().__init__()
        self.phrase = phrase

    def filter(self, record: logging.LogRecord) -> bool:
        return self.phrase not in record.getMessage()


def drop_benign_torch_warnings() -> None:
    """Install the filters of `BENIGN` on their loggers (once each, however often it is called)."""
    for name, phrase in BENIGN:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropPhrase) and f.phrase == phrase for f in target.filters):
            target.addFilter(_DropPhrase(phrase))
