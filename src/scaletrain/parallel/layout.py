"""The parallel layout: one validated value of parallel degrees.

Today it holds the data-parallel replicate degree; FSDP sharding, tensor and pipeline
parallel degrees join it as fields with default 1, and `build_mesh` then names one
DeviceMesh dimension per degree. It is a frozen dataclass that checks itself and can be
tested without any process group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class LayoutError(ValueError):
    """Degrees that do not fit the world size."""


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = -1  # data-parallel replicas; -1 = whatever the world size leaves over

    def resolve(self, world_size: int) -> "ParallelLayout":
        """Infer -1 degrees from the world size and check the product equals it.

        Args:
            world_size: total number of processes.

        Raises:
            LayoutError: a degree is invalid or the degrees do not multiply to world_size.
        """
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        if self.dp == 0 or self.dp < -1:
            raise LayoutError(f"parallel.dp = {self.dp} is invalid: allowed are -1 (infer) or >= 1")
        dp = world_size if self.dp == -1 else self.dp
        if dp != world_size:
            raise LayoutError(
                f"parallel.dp = {self.dp} does not match the world size {world_size} "
                f"(processes launched); use parallel.dp={world_size}, parallel.dp=-1, or launch "
                f"{self.dp} processes (--nproc {self.dp})"
            )
        return replace(self, dp=dp)

    @property
    def world_size(self) -> int:
        return self.dp

    def build_mesh(self, device_type: str):
        """A DeviceMesh with one named dimension per degree (today: ("dp",))."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp,), mesh_dim_names=("dp",))
