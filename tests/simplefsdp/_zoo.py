"""Small vision, audio and sequence models built from code (no downloads), and their training runs.

Each `ZooModel` says how to build the model (from seed 0), what one global batch looks like and
which repeated blocks the default bucket plan should find. `train_simplefsdp` trains it on every
rank of the default group (wrapped, compiled, the passes on) on this rank's share of each global
batch; `train_reference` computes in one process what those ranks do: each rank's share through the
same parameters with that rank's own buffers (BatchNorm statistics are per rank, see
`simplefsdp/replicated.py`), the mean of the ranks' losses differentiated, one optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import simplefsdp
from simplefsdp.passes.install import pass_of

STEPS = 3
GLOBAL_BATCH = 8
CLASSES = 5
LR = 0.1


# --- models ---------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input: a ResNet basic block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, LayerNorm over channels, inverted bottleneck MLP, residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.pwconv2 = nn.Linear(4 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # channels last, for LayerNorm and the MLP
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """Patchify stem, two blocks, a grouped-conv downsample, two blocks; used channels-last."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 2, stride=2)
        self.stage1 = nn.ModuleList([ConvNeXtBlock(channels), ConvNeXtBlock(channels)])
        self.down = nn.Conv2d(channels, 2 * channels, 2, stride=2, groups=2)
        self.stage2 = nn.ModuleList([ConvNeXtBlock(2 * channels), ConvNeXtBlock(2 * channels)])
        self.norm = nn.LayerNorm(2 * channels)
        self.head = nn.Linear(2 * channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.stage1:
            x = block(x)
        x = self.down(x)
        for block in self.stage2:
            x = block(x)
        return self.head(self.norm(x.mean((2, 3))))


class ViT(nn.Module):
    """Patch-embedding conv, class token, learned positions, pre-norm encoder layers."""

    def __init__(self, dim: int = 16, patch: int = 4, image: int = 8) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = dict(d_model=dim, nhead=2, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(**layer) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


class AudioConv(nn.Module):
    """1-D conv front end (strided), depthwise-separable conv blocks with BatchNorm1d, pooled head."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.frontend = nn.Conv1d(1, channels, 8, stride=4)
        self.blocks = nn.Sequential(*[self._block(channels) for _ in range(2)])
        self.head = nn.Linear(channels, CLASSES)

    @staticmethod
    def _block(channels: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv1d(channels, channels, 5, padding=2, groups=channels),
            nn.Conv1d(channels, channels, 1),
            nn.BatchNorm1d(channels),
            nn.GELU(),
        )

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.frontend(wave)).mean(-1))


class Recurrent(nn.Module):
    """Embedding, a 2-layer bidirectional LSTM, a GRU, a linear head on the last step."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(2 * dim, dim, batch_first=True)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(self.embed(tokens))
        x, _ = self.gru(x)
        return self.head(x[:, -1])


class CellLoop(nn.Module):
    """A GRU written as `nn.GRUCell` over the time steps: traced and compiled like any module."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.GRUCell(dim, dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], torch.Tensor]  # one global batch
    blocks: tuple[str, ...]  # what the default bucket plan finds (empty: the size-capped fallback)
    channels_last: bool = False  # model and inputs in channels-last memory format
    graphs: int = 1  # graphs dynamo compiles for one input shape (1: compiled with fullgraph=True)


def _images(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=gen)


def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 11, (GLOBAL_BATCH, 6), generator=gen)


ZOO = {
    "resnet": ZooModel(ResNet, _images, blocks=("layers.0", "layers.1")),
    "convnext": ZooModel(
        ConvNeXt, _images, blocks=("stage1.0", "stage1.1", "stage2.0", "stage2.1"), channels_last=True
    ),
    "vit": ZooModel(ViT, _images, blocks=("blocks.0", "blocks.1")),
    "audio": ZooModel(
        AudioConv, lambda gen: torch.randn(GLOBAL_BATCH, 1, 64, generator=gen), blocks=("blocks.0", "blocks.1")
    ),
    "recurrent": ZooModel(Recurrent, _tokens, blocks=(), graphs=3),  # before, between and after the RNNs
    "cell-loop": ZooModel(CellLoop, _tokens, blocks=()),
}


# --- training -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
    losses: list[float]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]  # this rank's (the reference: rank 0's)
    new_graphs: list[int] = dataclasses.field(default_factory=list)  # graphs dynamo compiled during each step
    plan: str = ""
    blocks: tuple[str, ...] = ()


def _fresh(spec: ZooModel) -> nn.Module:
    torch.manual_seed(0)
    model = spec.build()
    return model.to(memory_format=torch.channels_last) if spec.channels_last else model


def _batches(spec: ZooModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        x = spec.inputs(gen)
        x = x.to(memory_format=torch.channels_last) if spec.channels_last else x
        out.append((x, torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)))
    return out


def _full(tensors) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in tensors}


def _graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def train_simplefsdp(name: str, backend: str = "inductor") -> Result:
    spec = ZOO[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    model = simplefsdp.wrap(_fresh(spec), init_device_mesh("cpu", (world,)))
    step_fn = torch.compile(model, backend=backend, fullgraph=spec.graphs == 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, new_graphs = [], []
    for x, y in _batches(spec):
        before = _graphs_compiled()
        loss = F.cross_entropy(step_fn(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        new_graphs.append(_graphs_compiled() - before)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    bucket = pass_of(model).config.bucket
    return Result(
        losses,
        _full(model.named_parameters()),
        _full(model.named_buffers()),
        new_graphs,
        plan=bucket.plan,
        blocks=tuple(bucket.blocks),
    )


def train_reference(name: str, world: int) -> Result:
    spec = ZOO[name]
    model = _fresh(spec)
    params = dict(model.named_parameters())
    rank_buffers = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world)]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in _batches(spec):
        per_rank = [
            F.cross_entropy(torch.func.functional_call(model, {**params, **buffers}, (xs,)), ys)
            for buffers, xs, ys in zip(rank_buffers, x.chunk(world), y.chunk(world), strict=True)
        ]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return Result(losses, _full(model.named_parameters()), {n: b.clone() for n, b in rank_buffers[0].items()})


def sync_batchnorm_check() -> str:
    """A ResNet converted to `nn.SyncBatchNorm`, wrapped: in eval mode it computes what the unwrapped
    BatchNorm model does; returns the error a training-mode forward raises on the CPU. Eager: the
    compiled ResNet is `train_simplefsdp("resnet")`'s, and SyncBatchNorm adds nothing to trace in eval."""
    world = dist.get_world_size()
    model = simplefsdp.wrap(
        nn.SyncBatchNorm.convert_sync_batchnorm(_fresh(ZOO["resnet"])), init_device_mesh("cpu", (world,))
    )
    assert isinstance(model.stem[1], nn.SyncBatchNorm)
    assert isinstance(model.stem[1]._parameters["weight"], DTensor), "sharded like BatchNorm's"
    x, _ = _batches(ZOO["resnet"])[0]
    reference = _fresh(ZOO["resnet"]).eval()
    torch.testing.assert_close(model.eval()(x), reference(x))
    try:
        model.train()(x)
    except ValueError as e:
        return str(e)
    return ""


def batchnorm_checkpoint_check(root: str) -> dict[str, torch.Tensor]:
    """Each rank runs a training-mode forward on its own data (eager), so the BatchNorm statistics
    differ by rank; a sharded checkpoint saved then and loaded into a fresh wrapped model gives every
    rank rank 0's statistics. Returns this rank's buffers as loaded, and rank 0's as they were saved."""
    from simplefsdp import checkpoint

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = simplefsdp.wrap(_fresh(ZOO["resnet"]), mesh)
    model(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(dist.get_rank())))
    saved = {f"saved/{n}": b.clone() for n, b in model.named_buffers()}
    checkpoint.save_checkpoint(root, step=1, model=model)
    fresh = simplefsdp.wrap(_fresh(ZOO["resnet"]), mesh)
    checkpoint.load_checkpoint(root, model=fresh)
    return {**saved, **{f"loaded/{n}": b.clone() for n, b in fresh.named_buffers()}}
