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
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
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

    @classmethod
    def of(cls, mesh: jax.sharding.Mesh) -> MeshConfig:
        """The axis sizes of `mesh` (one made by make_mesh, or passing check_mesh)."""
        return cls(**{a: mesh_axis_size(mesh, a) for a in AXES})


def check_mesh(mesh: jax.sharding.Mesh) -> None:
    """ValueError unless `mesh` is one the models can be placed on: axes named among AXES, 'tensor'
    among them (the sharding rules place weights on it), each of Auto type (Explicit axes need
    sharding-in-types code)."""
    names = tuple(mesh.axis_names)
    odd = [n for n in names if n not in AXES]
    if odd:
        raise ValueError(f"mesh axes {names}: {odd} are not among {AXES} (MeshConfig.make_mesh builds a mesh)")
    if "tensor" not in names:
        raise ValueError(f"mesh axes {names} lack 'tensor', the axis the sharding rules place weights on: add it "
                         "(of size 1 for no tensor parallelism; MeshConfig.make_mesh builds a mesh)")
    auto = jax.sharding.AxisType.Auto
    types = getattr(mesh, "axis_types", None) or (auto,) * len(names)
    explicit = [n for n, t in zip(names, types) if t != auto]
    if explicit:
        raise ValueError(f"mesh axes {explicit} are not of Auto type (MeshConfig.make_mesh builds a mesh)")


def mesh_axis_size(mesh: jax.sharding.Mesh, axis: str) -> int:
    return dict(mesh.shape).get(axis, 1)
