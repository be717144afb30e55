"""Device mesh with the three serving axes: replica (independent model copies), context (ring
attention over long prompts) and tensor (Megatron-style split of heads and MLP)."""

from __future__ import annotations

import dataclasses
import jax
import numpy as np

AXES = ("replica", "context", "tensor")  # tensor innermost: its collectives run every layer


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    replica: int = 1
    tensor: int = 1
    context: int = 1

    def __post_init__(self):
        for name in AXES:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MeshConfig.{name} must be a positive int, got {v!r}")

    @property
    def num_devices(self) -> int:
        return self.replica * self.context * self.tensor

    def make_mesh(self, devices=None) -> jax.sharding.Mesh:
        """A mesh with Auto (GSPMD) axes over `devices` (default: all devices)."""
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.num_devices:
            raise ValueError(
                f"mesh replica={self.replica} x context={self.context} x tensor={self.tensor} needs "
                f"{self.num_devices} devices; {len(devices)} available"
            )
        shape = (self.replica, self.context, self.tensor)
        try:
            from jax.experimental import mesh_utils

            arr = mesh_utils.create_device_mesh(shape, devices=devices[: self.num_devices])
        except (ValueError, NotImplementedError, AssertionError):  # topologies mesh_utils can't lay out
            arr = np.asarray(devices[: self.num_devices]).reshape(shape)
        return jax.sharding.Mesh(arr, AXES)

    @classmethod
    def single_device(cls) -> MeshConfig:
        return cls()


def mesh_axis_size(mesh: jax.sharding.Mesh, axis: str) -> int:
    return dict(mesh.shape).get(axis, 1)
