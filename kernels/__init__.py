"""Fused copy kernels for bucketed collectives; importing this registers `torch.ops.simplefsdp.*`."""

from simplefsdp.kernels import copy_ops

__all__ = ["copy_ops"]
