"""`simplefsdp train`'s held-out loss (`--eval-every`) and its text sample at the end (`--sample-tokens`).

    held = HeldOut.of(config, corpus, dp_rank=dp_rank, dp_size=dp_size)
    loss = held.loss(step_fn, model, device=device)                  # collective: every rank calls it
    text = held.sample(step_fn, model, tokens=64, device=device)     # collective too

Both run under `torch.no_grad()` with the model in eval mode, on every rank: the model's gathers are
collectives, so a rank that skipped them would hang the others. Both read the corpus's held-out tail
(`data.split`), which training never draws from.

[Note: one no-grad graph]
An evaluation batch and a sampling window have the training input's shape `[batch_per_rank,
seq_len]`: under `torch.compile` the first evaluation compiles one more graph (no grad, eval mode),
which every later evaluation and sampling step reuses, and going back to training reuses the
training graph -- the guards tell them apart by grad mode and the modules' training flags. Without
evaluation the loop samples with the uncompiled model instead (`loop.py`): a few dozen forwards do
not pay for compiling a graph. Sampling keeps the shape (and layout: contiguous, as `lm_loss` passes
its inputs) by sliding: the window holds the last `seq_len` tokens (a prompt of `seq_len`
held-out tokens to start), each step appends the most likely next token and drops the oldest, so no
generation step compiles for a new length. Every row of the window holds the same tokens; row 0's
logits pick the next token, on every rank alike (greedy: no random numbers, the same choice on every
rank of one model).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from simplefsdp.train import hf_model
from simplefsdp.train.config import TrainConfig
from simplefsdp.train.data import CORPUS, VOCAB, encode, split

__all__ = ["EVAL_BATCHES", "HeldOut", "lm_loss"]

EVAL_BATCHES = 4  # batches of batch_per_rank windows per rank and evaluation: its cost is 4 forwards


def lm_loss(step_fn: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of `tokens` (`[B, S + 1]`): the model reads `[:, :-1]`, made
    contiguous as a sampling window is ([Note: one no-grad graph]: the guards compare strides too)."""
    logits = _logits(step_fn(tokens[:, :-1].contiguous()))  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _logits(output) -> torch.Tensor:
    return getattr(output, "logits", output)  # a transformers model returns an output object


@contextlib.contextmanager
def _inference(model: nn.Module) -> Iterator[None]:
    """No autograd, modules in eval mode (no dropout); training mode again after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _decoder(config: TrainConfig) -> tuple[int | None, Callable[[list[int]], str]]:
    """(how many of the first logits a sampled token may come from, None: all; ids -> text). The
    corpus's characters unless `--model` has a tokenizer: then a character model's vocabulary may be
    larger than the characters, and only they decode."""
    tokenizer = hf_model.tokenizer_of(config.model) if config.model else None
    if tokenizer is not None:
        return None, tokenizer.decode
    return len(VOCAB), lambda ids: "".join(VOCAB[i] for i in ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldOut:
    """This rank's evaluation batches and the sampling prompt, from the corpus's held-out tail."""

    batches: tuple[torch.Tensor, ...]  # EVAL_BATCHES x [batch_per_rank, seq_len + 1]
    prompt: torch.Tensor  # [seq_len]: the tail's first tokens
    limit: int | None  # a sampled token is among the first `limit` logits (the characters); None: any
    decode: Callable[[list[int]], str]  # token ids -> text

    @classmethod
    def of(cls, config: TrainConfig, corpus: torch.Tensor | None, *, dp_rank: int, dp_size: int) -> HeldOut:
        """`corpus`: the token ids (None: the built-in characters). Windows start at evenly spaced
        offsets over the tail, the same for every run of one configuration; each data-parallel rank
        takes its `batch_per_rank` of every batch, as in training."""
        _, tail = split(encode(CORPUS) if corpus is None else corpus, seq_len=config.seq_len)
        count = EVAL_BATCHES * dp_size * config.batch_per_rank
        starts = torch.linspace(0, len(tail) - config.seq_len - 1, count).round().long()
        mine = starts.view(EVAL_BATCHES, dp_size, config.batch_per_rank)[:, dp_rank]  # [E, B]
        windows = tail[mine[..., None] + torch.arange(config.seq_len + 1)]  # [E, B, S + 1]
        limit, decode = _decoder(config)
        return cls(batches=tuple(windows), prompt=tail[: config.seq_len], limit=limit, decode=decode)

    def loss(self, step_fn: nn.Module, model: nn.Module, *, device: torch.device) -> float:
        """Collective: the mean loss over the held-out batches of every data-parallel rank."""
        with _inference(model):
            total = sum(lm_loss(step_fn, batch.to(device)) for batch in self.batches) / len(self.batches)
        dist.all_reduce(total)  # the tp ranks of one dp rank hold the same loss: the mean is the dp mean
        return total.item() / dist.get_world_size()

    def sample(self, step_fn: nn.Module, model: nn.Module, *, tokens: int, device: torch.device) -> str:
        """Collective: `tokens` greedily chosen tokens after the prompt, as text ([Note: one no-grad graph])."""
        window = self.prompt.to(device).expand(len(self.batches[0]), -1).clone()  # [B, S], rows alike
        chosen = []
        with _inference(model):
            for _ in range(tokens):
                logits = _logits(step_fn(window))[0, -1, : self.limit]  # [V]
                token = logits.argmax()
                chosen.append(token)
                window = torch.cat([window[:, 1:], token.expand(len(window), 1)], dim=1)
        return self.decode(torch.stack(chosen).tolist() if chosen else [])
