"""The embedded corpus and a deterministic, resumable batch iterator over it.

[Note: why an embedded character corpus]
`simplefsdp train` must run on a fresh machine without a download. A paragraph of text, tokenized
by character, is enough for the loss to fall visibly within a few hundred steps; a real data
pipeline plugs in where `TokenBatches` is used (`loop.py`).

[Note: the held-out tail]
The corpus's last tokens -- a tenth of them, or `seq_len + 1` if that is more, so one window fits --
are held out: `split` gives the two parts, training batches are drawn from the head only, and
`--eval-every` measures the loss on the tail (`evaluate.py`). The tail is held out whether evaluation
runs or not, so a run's training data do not depend on it.

Invariants: batch `i` depends only on `(seed, i)`, so the global batch is the same for any world
size (each data-parallel rank takes its contiguous slice of it) and resuming at position `i` gives
exactly the batches an uninterrupted run would have drawn; the iterator's whole state is
`state_dict()`, which checkpoints store as JSON.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CORPUS", "HELD_OUT_FRACTION", "VOCAB", "TokenBatches", "encode", "repeated_corpus", "split"]

CORPUS = """\
Sharding a model means that no single worker holds all of it. Each worker keeps one slice of every
weight, and before a layer runs the workers trade slices so that each of them briefly holds the whole
layer. When the layer is done the borrowed slices are dropped again. Gradients travel the other way:
each worker computes a gradient for the whole layer, and the workers add their gradients together
so that each keeps only the sum for its own slice. A compiler that sees these exchanges in the graph
can start the next exchange while the current layer is still computing, and can pack many small
exchanges into one large one. That is the whole idea: keep the model code plain, and let the
compiler schedule the communication around the computation.
"""

VOCAB = sorted(set(CORPUS))
HELD_OUT_FRACTION = 0.1  # of the corpus's tokens, at its end: [Note: the held-out tail]


def encode(text: str) -> torch.Tensor:
    """Token ids of `text` (`[len(text)]`, int64); every character must be in `VOCAB`."""
    return torch.tensor([VOCAB.index(ch) for ch in text])


def split(ids: torch.Tensor, *, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training head, held-out tail) of the corpus `ids` ([Note: the held-out tail]); ValueError
    unless both hold a window of `seq_len + 1` tokens (the head: more than one, to draw from)."""
    held = max(math.ceil(len(ids) * HELD_OUT_FRACTION), seq_len + 1)
    if len(ids) - held <= seq_len + 1:
        raise ValueError(
            f"seq_len ({seq_len}) must be shorter than the corpus's training part ({len(ids) - held} of "
            f"{len(ids)} tokens; {held} are held out for evaluation)"
        )
    return ids[:-held], ids[-held:]


def repeated_corpus(*, seq_len: int) -> torch.Tensor:
    """The corpus's token ids, repeated as often as windows of `seq_len + 1` tokens need (at least
    once), in host memory whatever the default device: a named shape's sequences (8192 for Llama 3)
    are longer than the corpus. Longer than `2 * (seq_len + 2)` tokens, so that `split` leaves a
    window in the training head and one in the held-out tail (the tail then repeats text the head
    holds: a long shape's held-out loss is not held out)."""
    with torch.device("cpu"):
        ids = encode(CORPUS)
    return ids.repeat(max(1, -(-(2 * (seq_len + 2) + 1) // len(ids))))


class TokenBatches:
    """`[batch_per_rank, seq_len + 1]` windows of the corpus's training head for one data-parallel rank,
    batch after batch."""

    def __init__(
        self,
        *,
        seq_len: int,
        batch_per_rank: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        ids: torch.Tensor | None = None,
    ) -> None:
        """`ids`: the corpus as token ids (`[N]`, int64); None: its characters (`encode(CORPUS)`).
        Batches come from its training head only (`split`)."""
        self._ids, _ = split(encode(CORPUS) if ids is None else ids, seq_len=seq_len)
        self.seq_len, self.batch_per_rank, self.seed = seq_len, batch_per_rank, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # batches drawn so far

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        count = self.batch_per_rank * self.dp_size
        starts = torch.randint(0, len(self._ids) - self.seq_len, (count,), generator=gen)  # the last: S + 1 to the end
        mine = starts.chunk(self.dp_size)[self.dp_rank]
        self.position += 1
        offsets = mine[:, None] + torch.arange(self.seq_len + 1)  # [B, S + 1]
        return self._ids[offsets]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "global_batch": self.batch_per_rank * self.dp_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; the seed and the global batch must be the ones it was saved with."""
        saved = (state["seed"], state["global_batch"])
        if saved != (self.seed, self.batch_per_rank * self.dp_size):
            raise ValueError(
                f"the checkpoint's data order (seed, global batch) = {saved} differs from this run's "
                f"{(self.seed, self.batch_per_rank * self.dp_size)}: resuming would not continue the same run"
            )
        self.position = int(state["position"])
