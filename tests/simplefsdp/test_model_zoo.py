"""Beyond transformers: conv nets, a ViT, a 1-D audio net and recurrent models train under
`wrap` + `torch.compile` (inductor, the passes on) on 2 gloo ranks like one process.

The models are in `_zoo.py`. Each is compared with the one-process run of what the ranks do
(`_zoo.train_reference`) by losses, parameters and rank 0's buffers within the fp32 parity
tolerance; compiles the number of graphs its `ZooModel` states in the first step and none after
(one compile per shape; the recurrent model's eager LSTM and GRU split its forward in three, see
[Note: recurrent modules run eagerly]); and gets the bucket plan its `ZooModel` states: its
repeated blocks, or the size-capped fallback when it has none.
"""

from __future__ import annotations

import pytest
import torch

from tests._tiers import fast_first
from tests.simplefsdp import _zoo
from tests.simplefsdp.test_training import FP32_TOL

pytestmark = pytest.mark.timeout(420)

# The recurrent model stays in the fast tier (the eager-RNN path; its compile is the cheapest);
# the conv nets (inductor building their convolution kernels), the ViT and the audio net run in the
# full suite. BatchNorm's rank-0 statistics stay in the fast tier through the checkpoint test below.
ORDER = ["recurrent", "resnet", "convnext", "vit", "audio", "cell-loop"]


@pytest.mark.parametrize("name", fast_first(ORDER))
def test_trains_like_one_process(ranks2, name):
    results = ranks2.run(_zoo.train_simplefsdp, name)
    ours = results[0]
    assert results[1].losses == ours.losses, "every rank saw the same global losses"
    for fqn, value in ours.params.items():
        assert torch.equal(results[1].params[fqn], value), f"{fqn}: ranks disagree"
    assert ours.losses[-1] < ours.losses[0], "training should make progress"

    reference = _zoo.train_reference(name, world=2)
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(reference.losses), **FP32_TOL)
    assert ours.params.keys() == reference.params.keys()
    for fqn, value in reference.params.items():
        torch.testing.assert_close(ours.params[fqn], value, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")
    # BatchNorm statistics are per rank: rank 0's follow rank 0's batches only
    for fqn, value in reference.buffers.items():
        torch.testing.assert_close(ours.buffers[fqn], value, **FP32_TOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")

    spec = _zoo.ZOO[name]
    steps = len(ours.new_graphs)
    assert ours.new_graphs == [spec.graphs] + [0] * (steps - 1), "graphs compiled per step: one compile, no recompiles"
    assert (ours.plan, ours.blocks) == (("blocks", spec.blocks) if spec.blocks else ("cap", ())), name


def test_sync_batchnorm_composes(ranks2):
    """`nn.SyncBatchNorm.convert_sync_batchnorm` before `wrap`: its parameters are sharded and
    gathered like BatchNorm's, and eval mode matches one process. Training mode needs torch's
    SyncBatchNorm kernels, which exist for GPUs only: on the CPU torch refuses, with its own error."""
    errors = ranks2.run(_zoo.sync_batchnorm_check)
    assert all("SyncBatchNorm expected input tensor to be on GPU" in e for e in errors), errors


def test_checkpoint_keeps_rank0_batchnorm_statistics(ranks2, tmp_path):
    """[Note: BatchNorm in training mode]: per-rank statistics; a checkpoint stores rank 0's."""
    ranks = ranks2.run(_zoo.batchnorm_checkpoint_check, str(tmp_path))
    name = "stem.1.running_mean"
    assert not torch.equal(ranks[0][f"saved/{name}"], ranks[1][f"saved/{name}"]), "statistics differ by rank"
    for key in (k for k in ranks[0] if k.startswith("saved/")):
        loaded = key.replace("saved/", "loaded/")
        for rank, buffers in enumerate(ranks):
            assert torch.equal(buffers[loaded], ranks[0][key]), f"rank {rank}: {loaded} is not rank 0's"
