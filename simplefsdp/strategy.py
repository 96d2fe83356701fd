"""Sharding strategies: the names users know from FSDP1, Accelerate and DeepSpeed, and what each means.

| strategy             | mesh | placements on the data-parallel mesh | reshard after forward | ZeRO    |
| -------------------- | ---- | ------------------------------------ | --------------------- | ------- |
| `FULL_SHARD`         | 1-D  | `Shard(0)`                           | yes                   | 3       |
| `SHARD_GRAD_OP`      | 1-D  | `Shard(0)`                           | no                    | 2       |
| `NO_SHARD`           | 1-D  | `Replicate()`                        | (nothing to reshard)  | DDP     |
| `HYBRID_SHARD`       | 2-D  | `(Replicate(), Shard(0))`            | yes                   | 3 + DDP |
| `HYBRID_SHARD_ZERO2` | 2-D  | `(Replicate(), Shard(0))`            | no                    | 2 + DDP |

For the 2-D strategies the mesh is `(replicate, shard)`: dim 0 replicates across groups (nodes),
dim 1 shards within a group.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = ["ShardingStrategy"]


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are spread over the data-parallel mesh."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Accept the enum or its name, case-insensitively; anything else is a `ValueError` listing the names."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        names = ", ".join(cls.__members__)
        raise ValueError(f"unknown sharding strategy {value!r}; expected one of: {names}")

    @property
    def mesh_ndim(self) -> int:
        """Number of dims the data-parallel mesh must have."""
        return 2 if self.is_hybrid else 1

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def shards(self) -> bool:
        return self is not ShardingStrategy.NO_SHARD

    @property
    def reshard_after_forward(self) -> bool:
        """The default for `wrap(reshard_after_forward=None)`: ZeRO-3 strategies re-gather in backward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    def placements(self, *, param_ndim: int) -> tuple[Placement, ...]:
        """Placements of a parameter with `param_ndim` dims on this strategy's mesh.

        A 0-dim parameter has no dim 0 to shard, so it is replicated on every mesh dim.
        """
        # imported here: the strategy names are parsed by command lines before torch loads
        from torch.distributed.tensor import Replicate, Shard

        shard: Placement = Shard(0) if self.shards and param_ndim > 0 else Replicate()
        return (Replicate(), shard) if self.is_hybrid else (shard,)
