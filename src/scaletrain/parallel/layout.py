"""The parallel layout: one validated value of parallel degrees, and the DeviceMesh it names.

Four degrees multiply to the world size:

    pp            pipeline stages (parallel/pipeline.py)
    dp_replicate  data-parallel replicas that hold whole parameters (DDP), or the replicate
                  dimension of HSDP (dp_replicate x dp_shard)
    dp_shard      data-parallel ranks that shard parameters, gradients and optimizer state
                  (FSDP2, parallel/fsdp.py)
    tp            tensor-parallel ranks that split each block's matmuls (parallel/tensor.py)

Ranks are laid out row-major over ("pp", "dp_replicate", "dp_shard", "tp"), as torchtitan
does: tensor-parallel peers are neighbours (on a GPU node they share the fastest links), the
pipeline dimension is outermost (it sends the least). `build_mesh` names one DeviceMesh
dimension per degree above 1. The data-parallel rank of a process, which picks its share of
every global batch, is its coordinate over (dp_replicate, dp_shard): tensor-parallel and
pipeline peers read the same examples.

A frozen dataclass that checks itself and is testable without any process group.
`layout_of` reads the [parallel] degrees as plain numbers (the config's section is handed
down by launch/resolve.resolve, this room imports nothing above it) and raises `LayoutError`, a
`ConfigError` naming the key the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scaletrain.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ConfigError):
    """Degrees that do not fit the world size (a user mistake: shown as one paragraph)."""


@dataclass(frozen=True)
class ParallelLayout:
    dp_replicate: int = -1  # -1: whatever the world size leaves over
    dp_shard: int = 1  # -1: whatever the world size leaves over
    tp: int = 1
    pp: int = 1

    def resolve(self, world_size: int) -> ParallelLayout:
        """Infer a -1 degree from the world size and check the product equals it.

        At most one of dp_replicate and dp_shard may be -1; when dp_shard is -1, an unset
        (-1) dp_replicate counts as 1 (the world is sharded, not replicated). Next to tensor
        or pipeline parallelism an unset dp_replicate also counts as 1 and the ranks left
        over shard (dp_shard), as torchtitan's default does: DDP does not compose with them.

        Raises:
            LayoutError: a degree is invalid or the degrees do not multiply to world_size.
        """
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        for key in MESH_DIMS:
            value = getattr(self, key)
            lowest = -1 if key.startswith("dp") else 1
            if value == 0 or value < lowest:
                allowed = "-1 (infer) or >= 1" if lowest == -1 else ">= 1"
                raise LayoutError(f"parallel.{key} = {value} is invalid: allowed are {allowed}")
        replicate, shard = self.dp_replicate, self.dp_shard
        if replicate == -1 and shard == 1 and (self.tp > 1 or self.pp > 1):
            shard = -1  # the data-parallel ranks next to TP or PP are FSDP's
        if replicate == -1 and shard == -1:
            replicate = 1
        self = replace(self, dp_shard=shard)
        fixed = self.tp * self.pp * max(replicate, 1) * max(self.dp_shard, 1)
        if -1 in (replicate, self.dp_shard):
            if world_size % fixed:
                raise LayoutError(
                    f"{self._product(replicate)} = {fixed} does not divide the "
                    f"world size {world_size}, so the -1 degree cannot be "
                    f"inferred; launch a multiple of {fixed} processes"
                )
            inferred = world_size // fixed
            resolved = replace(
                self,
                dp_replicate=inferred if replicate == -1 else replicate,
                dp_shard=inferred if self.dp_shard == -1 else self.dp_shard,
            )
        else:
            resolved = replace(self, dp_replicate=replicate)
        if resolved.world_size != world_size:
            raise LayoutError(
                f"the parallel degrees {resolved._product(resolved.dp_replicate)} = "
                f"{resolved.world_size} do not match the world size {world_size} (processes "
                f"launched); change the degrees, set parallel.dp_replicate=-1 or "
                f"parallel.dp_shard=-1 to infer one, or launch {resolved.world_size} "
                f"processes (--nproc {resolved.world_size})"
            )
        return resolved

    def _product(self, replicate: int) -> str:
        return (
            f"parallel.pp = {self.pp} x parallel.dp_replicate = {replicate} x "
            f"parallel.dp_shard = {self.dp_shard} x parallel.tp = {self.tp}"
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many distinct shares each global batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh: each degree above 1 by name, outermost first."""
        return {k: getattr(self, k) for k in MESH_DIMS if getattr(self, k) > 1}

    @property
    def splits_gradients(self) -> bool:
        """Some rank holds only part of the gradient (FSDP, TP or PP): every layout but DDP
        or one process. Their loss scaler must agree on an overflow across ranks."""
        return self.world_size > self.dp_replicate

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dimension (row-major over MESH_DIMS)."""
        out = {}
        for key in reversed(MESH_DIMS):
            size = getattr(self, key)
            out[key], rank = rank % size, rank // size
        return {k: out[k] for k in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which share of the global batch `rank` reads (its place among the dp ranks)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def reports_loss(self, rank: int) -> bool:
        """One rank per data-parallel share counts its loss in the logged sums: tensor-
        parallel peers compute the same loss, and only the last pipeline stage has one."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["pp"] == self.pp - 1

    def build_mesh(self, device_type: str):
        """The named DeviceMesh (None in a world of one process: nothing to communicate).

        Two pairs of dimensions are also flattened into one (a collective: every rank builds
        the mesh): "dp" = (dp_replicate, dp_shard), the data-parallel group that HSDP's
        counts are summed over (`dp_group`), and "dp_shard_tp" = (dp_shard, tp), over which
        DTensor then reduces a 2-D parameter's gradient norm in one all-reduce instead of
        two in a row (training/grad_norm.py; it finds the flattened mesh by its ranks).
        """
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes
        mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        # torch 2.13 names this private; torchtitan builds its "dp" and "dp_shard_cp" so.
        if self.dp_replicate > 1 and self.dp_shard > 1:
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
        if self.dp_shard > 1 and self.tp > 1:
            mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
        return mesh

    def dp_group(self, mesh):
        """The process group of this rank's data-parallel peers: the ranks that read the
        other shares of the global batch (tensor-parallel and pipeline peers read the same
        share, so a count or a loss summed over the world would count each example tp x pp
        times). None when there is none to reduce over (one process, or dp = 1)."""
        if mesh is None or self.dp == 1:
            return None
        if self.dp_replicate > 1 and self.dp_shard > 1:
            # the "dp" build_mesh flattened (built once: the same name and ranks return it);
            # mesh["dp"] would warn that slicing a flattened dim from the root is deprecated
            return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        return mesh["dp_replicate" if self.dp_replicate > 1 else "dp_shard"].get_group()

    def describe(self) -> str:
        """e.g. 'pp=2 x dp_shard=2 (4 ranks)'; '1 process' when nothing is parallel."""
        sizes = self.sizes
        if not sizes:
            return "1 process"
        return " x ".join(f"{k}={v}" for k, v in sizes.items()) + f" ({self.world_size} ranks)"


def layout_of(
    *, dp: int, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int
) -> ParallelLayout:
    """The [parallel] degrees, checked against the world size.

    `dp` is the older name of `dp_replicate` (-1 = not given); a message names the one the
    user wrote.

    Raises:
        LayoutError: the two names disagree, or the degrees do not fit `world_size`.
    """
    if dp != -1 and dp_replicate != -1 and dp != dp_replicate:
        raise LayoutError(
            f"parallel.dp = {dp} and parallel.dp_replicate = {dp_replicate} "
            "disagree: parallel.dp is the older name of dp_replicate; give one"
        )
    replicate = dp_replicate if dp_replicate != -1 else dp
    try:
        return ParallelLayout(dp_replicate=replicate, dp_shard=dp_shard, tp=tp, pp=pp).resolve(
            world_size
        )
    except LayoutError as e:
        if dp == -1:
            raise
        raise LayoutError(str(e).replace("parallel.dp_replicate", "parallel.dp")) from None
