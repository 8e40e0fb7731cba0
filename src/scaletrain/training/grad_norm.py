"""The global gradient norm, and clipping to it, under every layout.

What each rank holds of a gradient differs by layout: the whole of it (DDP, and the
embeddings, norms and head under tensor parallelism, which every TP rank holds alike), a
dim-0 shard (FSDP: a DTensor on the data-parallel mesh), a slice by heads or features (TP:
a DTensor on the "tp" mesh), or nothing at all (another pipeline stage's blocks). The norm
that clipping and the logged grad_norm use must be the norm of the one full gradient, the
same number on every rank, or ranks clip differently and drift apart (pytorch#170862 is
this bug: a local norm taken for the global one). So:

- plain tensors are counted as they are (every rank that holds one holds all of it);
- DTensors are grouped by mesh and placements and reduced by DTensor itself (the norm of a
  sharded DTensor is a partial value; `full_tensor()` sums the shards' squares over the
  mesh, and leaves a replicated one alone);
- under pipeline parallelism the squared norms of the stages are summed over the "pp"
  process group.

The squares are summed in float64, so the order the pieces arrive in does not matter at
the tolerance the parity tests use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_grad_norm(grads: list[torch.Tensor], *, pp_group=None) -> torch.Tensor:
    """L2 norm of the whole model's gradient, on every rank alike (float64 scalar, inf or
    nan when a gradient is non-finite).

    Args:
        grads: this rank's gradients (plain tensors and DTensors).
        pp_group: the pipeline's process group when pp > 1 (its stages hold disjoint blocks).
    """
    from torch.distributed.tensor import DTensor

    plain = [g for g in grads if not isinstance(g, DTensor)]
    by_layout: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            by_layout.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    if plain:
        squares += torch.nn.utils.get_total_norm(plain, foreach=True).double() ** 2
    for group in by_layout.values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        squares += norm.full_tensor().double() ** 2
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_grads_(grads: list[torch.Tensor], *, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm) in place (torch's clipping
    rule, with its 1e-6 guard), plain tensors and DTensors alike."""
    from torch.distributed.tensor import DTensor

    coef = float(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))
    if coef == 1.0:
        return
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if plain:
        torch._foreach_mul_(plain, coef)
    if sharded:
        torch._foreach_mul_(sharded, coef)
