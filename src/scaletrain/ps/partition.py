"""Which server holds which parameters: balanced by bytes, decided the same on every rank.

Greedy longest-processing-time: the largest tensor first, each to the server that holds the
fewest bytes so far (ties to the lowest index). It is a pure function of the names and
sizes, which every rank computes from its own copy of the model, so no rank has to tell
another. Within a server the names keep the model's order.
"""

from __future__ import annotations

import torch

from scaletrain.errors import UserError


class PartitionError(UserError):
    """More servers than parameter tensors; the message says how many there are."""


def partition_by_bytes(sizes: dict[str, int], *, servers: int) -> list[list[str]]:
    """Split parameter names over `servers` so that their bytes are as even as greedy gets.

    Args:
        sizes: bytes of each parameter, by name, in the model's order.
        servers: how many servers share them.
    """
    if len(sizes) < servers:
        raise PartitionError(
            f"ps.servers = {servers} but the model has only {len(sizes)} "
            f"parameter tensors: every server needs at least one; use "
            f"ps.servers <= {len(sizes)}"
        )
    load, owner = [0] * servers, {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: ties keep model order
        k = min(range(servers), key=lambda i: (load[i], i))
        owner[name] = k
        load[k] += sizes[name]
    return [[n for n in sizes if owner[n] == k] for k in range(servers)]


def model_partition(model: torch.nn.Module, *, servers: int) -> list[list[str]]:
    """`partition_by_bytes` over the model's trainable parameters."""
    sizes = {
        n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad
    }
    return partition_by_bytes(sizes, servers=servers)
