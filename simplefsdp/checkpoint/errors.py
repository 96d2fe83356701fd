"""The errors the checkpoint functions raise: one family, so callers can catch them together."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError", "RankTimeoutError", "StateDictMismatchError"]


class CheckpointError(Exception):
    """Base class of every error raised by `simplefsdp.checkpoint`."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is incomplete, truncated or its bytes differ from its manifest.

    `path` is the checkpoint directory, `problems` one line per file at fault.
    """

    def __init__(self, path: object, problems: list[str]) -> None:
        self.path = path
        self.problems = list(problems)
        listed = "\n  ".join(self.problems)
        super().__init__(f"checkpoint {path} is corrupt or incomplete:\n  {listed}")


class StateDictMismatchError(CheckpointError, ValueError):
    """The keys, shapes or dtypes of a saved state differ from the model's (or optimizer's).

    Each list holds one human-readable line per key, naming the key and its shapes / dtypes.
    """

    def __init__(self, source: object, *, missing: list[str], unexpected: list[str], mismatched: list[str]) -> None:
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        parts = [f"state in {source} does not fit the model:"]
        for title, lines in (
            ("missing in the checkpoint (the model has them)", self.missing),
            ("unexpected (in the checkpoint, not in the model)", self.unexpected),
            ("shape or dtype mismatch (checkpoint vs model)", self.mismatched),
        ):
            if lines:
                parts.append(f"{len(lines)} {title}:\n    " + "\n    ".join(lines))
        super().__init__("\n  ".join(parts))


class RankTimeoutError(CheckpointError, TimeoutError):
    """Some ranks did not reach a synchronization point in time: they died, hang or diverged."""
