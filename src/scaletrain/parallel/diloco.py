"""DiLoCo and Streaming DiLoCo: islands that train apart and meet every H steps.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): the islands, the mesh's `dp_replicate`
coordinates, each take H inner steps with their own optimizer and nothing crosses between
them. Then every rank computes its pseudo-gradient, anchor - parameters, on its own local
shard. The islands average it over `dp_replicate`, and one step of an outer optimizer
(SGD, Nesterov momentum) moves the anchor. The parameters become the new anchor; the
inner optimizer's state is kept, as in the paper.

- Inside an island any layout runs unchanged: FSDP over `dp_shard` alone (no HSDP
  replication, parallel/compose.py), tensor parallel, pipeline stages. Ranks that hold the
  same shard in every island form one `dp_replicate` group. Each exchanges and steps just
  its own shard, so the anchor and the outer momentum are sharded like the parameters.
  Without an all-reduce over `dp_replicate`, the train step normalises over the island's
  own data-parallel ranks (training/build.py hands it their group).
- The average is weighted by the examples or tokens each island trained on since the
  fragment last synced (FedAvg). With H = 1, plain inner SGD and an outer SGD step of lr 1,
  this is DDP's gradient exactly, ragged counts included; an unweighted mean is not.
- Streaming DiLoCo (arXiv 2501.18512): the model's blocks fall into F contiguous
  fragments (the embeddings join the first, what follows the blocks the last). Fragment f
  syncs at inner steps t with (t - f H / F) % H == 0, with its own anchor slice and outer
  step. With `overlap_steps` tau > 0 its exchange runs in the background
  (`async_op=True`). The outer update lands tau steps later, mixed into the parameters
  trained meanwhile: local x alpha + global x (1 - alpha).
- Quantized exchange (`quantize`): "none" all-reduces the weighted pseudo-gradient (on
  ragged data the weight rides as one more element; on packed data the counts are equal
  and it sends the pseudo-gradient alone) in the parameters' dtype, fp32 at least. bf16, fp16,
  int8 and int4 are all-gathered and summed in fp32 (or the wider master dtype) on every
  rank instead. A sum of codes with different scales means nothing, and a bf16 ring
  all-reduce would round once per hop, its error growing with the islands; the price is
  that a ring all-gather sends (islands - 1) payloads where an all-reduce sends
  2 (islands - 1) / islands buffers, the same at 2 islands. int8 and int4 carry one fp32 absmax scale per
  `quantize_block` elements; int4 packs two codes a byte. Each island's payload is one
  uint8 buffer: weight, scales, codes. Every rank then sums the same bytes in the same
  order, so the islands' anchors stay bit-identical.
- The last step of a run (train.steps) syncs every fragment whatever H says, so the
  final model is the islands' common one. A planned stop (train.stop_after) does not.
- Checkpoints: `state_dict` holds the inner-step position, the anchors and the outer
  momentum (DTensors where the parameters are, so they reshard), each island's counts since
  each fragment's last sync, and when a pending outer update is due. An exchange still in
  flight is finished first: its outer step only reads what it read at the start, so taking
  it early changes no bit.

With one island (or one process) no collective runs and the same code trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.parallel.quantize import decode, encode

_WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's prefix


class DiLoCoKeys(Protocol):
    """The [diloco] keys read here (config.DiLoCoConfig, which this room does not import)."""

    sync_every: int
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    fragments: int
    overlap_steps: int
    overlap_alpha: float
    quantize: str
    quantize_block: int


# --------------------------------------------------------------------------- checks


def check_diloco(keys: DiLoCoKeys, *, island_splits: bool, comm_hook: str, precision: str) -> None:
    """Refuse [diloco] values that cannot work together, before any process starts.

    Args:
        keys: the frozen [diloco] section.
        island_splits: an island spans several ranks (dp_shard, tp or pp above 1).
        comm_hook: parallel.comm_hook; precision: precision.mode.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    h, f = keys.sync_every, keys.fragments
    if keys.nesterov and keys.outer_momentum == 0:
        raise ConfigError(
            "diloco.nesterov = true needs diloco.outer_momentum > 0 (Nesterov momentum "
            "without momentum is undefined); set diloco.nesterov=false for plain outer SGD"
        )
    if h % f:
        raise ConfigError(
            f"diloco.sync_every = {h} must be a multiple of diloco.fragments = {f}: each "
            f"fragment syncs every sync_every steps, fragment k at an offset of k x "
            f"sync_every / fragments; e.g. diloco.sync_every={max(f, h // f * f)}"
        )
    if keys.overlap_steps >= h // f:
        raise ConfigError(
            f"diloco.overlap_steps = {keys.overlap_steps} must be below diloco.sync_every / "
            f"diloco.fragments = {h // f}: an exchange's outer update must land before the "
            "next exchange starts"
        )
    if keys.quantize_block % 2:
        raise ConfigError(
            f"diloco.quantize_block = {keys.quantize_block} must be even (int4 packs two "
            "codes a byte)"
        )
    if comm_hook != "none":
        raise ConfigError(
            f"parallel.comm_hook = {comm_hook!r} compresses DDP's gradient all-reduce, "
            "which parallel.strategy = 'diloco' does not run: islands exchange pseudo-"
            "gradients instead; compress those with diloco.quantize, and set "
            "parallel.comm_hook='none'"
        )
    if precision == "fp16-mixed" and island_splits:
        raise ConfigError(
            "precision.mode = 'fp16-mixed' with parallel.strategy = 'diloco' and an island "
            "of several ranks: the sharded loss scaler agrees on overflows over every rank, "
            "a collective between the islands on each step; use bf16-mixed, or islands of "
            "one rank (dp_shard = tp = pp = 1)"
        )


def check_fragments(n_blocks: int, fragments: int, *, model_label: str) -> None:
    """Streaming DiLoCo's fragments split the model's blocks evenly.

    Raises:
        ConfigError: the blocks do not divide into `fragments`.
    """
    if fragments == 1 or (n_blocks and n_blocks % fragments == 0):
        return
    if not n_blocks:
        raise ConfigError(
            f"diloco.fragments = {fragments}: {model_label} declares no repeated blocks to "
            "split into fragments; use diloco.fragments=1"
        )
    divisors = [d for d in range(1, n_blocks + 1) if n_blocks % d == 0]
    raise ConfigError(
        f"diloco.fragments = {fragments}: {model_label} has {n_blocks} repeated blocks, "
        f"which must divide evenly into the fragments; allowed: {divisors}"
    )


def assign_fragments(model: nn.Module, *, blocks: str | None, fragments: int) -> dict[str, int]:
    """{parameter name: its fragment} on the bare model (before any technique renames or
    splits it): block i of n goes to fragment i x fragments // n; parameters before the
    first block (embeddings) to fragment 0, after the blocks (final norm, head) to the last.
    """
    children = list(model.get_submodule(blocks).named_children()) if blocks else []
    check_fragments(len(children), fragments, model_label="the model")
    position = {f"{blocks}.{name}.": i for i, (name, _) in enumerate(children)}
    out, after_blocks = {}, False
    for name, _ in model.named_parameters():
        i = next((pos for prefix, pos in position.items() if name.startswith(prefix)), None)
        if i is not None:
            out[name], after_blocks = i * fragments // len(children), True
        else:
            out[name] = fragments - 1 if after_blocks else 0
    return out


def plain_name(name: str) -> str:
    """A parameter's name as the bare model and the checkpoints spell it (no DDP or
    activation-checkpointing prefix)."""
    return name.removeprefix("module.").replace(_WRAPPED, "")


# --------------------------------------------------------------------------- the technique


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter, in place (a DTensor's local shard; under no_grad
    that is its storage, not a copy). Read afresh each time: FSDP may re-home its shards."""
    return p.to_local() if hasattr(p, "to_local") else p


def _as_saved(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` laid out as the parameter `like` (a DTensor view of it for the checkpoint,
    so torch.distributed.checkpoint reshards it), or `local` itself for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


@dataclass
class _Exchange:
    """A fragment's exchange under way: its collective, what it fills, when it lands."""

    work: object | None  # the async collective's handle (None: done or nothing to wait for)
    buffer: torch.Tensor | None  # the all-reduced or all-gathered buffer
    numel: int
    due: int  # the inner step at which the outer update is merged into the parameters
    mix: bool  # merged with overlap_alpha (an overlapped exchange) or copied in
    settled: bool = False  # the outer step is done: the anchor is the new global one


class DiLoCo:
    """The anchors, the outer optimizer and the exchange schedule of one rank.

    Built by training/build.py over the trainable parameters, by `plain_name`; the loop
    calls `step` after every inner optimizer step. A DCP Stateful (`state_dict` /
    `load_state_dict`) identical on every island; `sent` is the per-rank part (bytes this
    rank handed to the exchange's collectives).
    """

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        keys: DiLoCoKeys,
        *,
        fragment_of: dict[str, int],
        group,
        island: int,
        islands: int,
        equal_counts: bool = False,
    ) -> None:
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.keys, self.group, self.island, self.islands = keys, group, island, islands
        # packed data: every island trains the same count a step, so the weights are equal
        # and need not travel (the mean is the weighted mean); ragged data sends them
        self.equal_counts = equal_counts
        self.members = [
            [i for i, n in enumerate(self.names) if fragment_of[n] == f]
            for f in range(keys.fragments)
        ]
        with torch.no_grad():
            self.anchors = [_local(p).detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(
            self.anchors,
            lr=keys.outer_lr,
            momentum=keys.outer_momentum,
            nesterov=keys.nesterov,
        )
        if keys.outer_momentum > 0:  # SGD starts a buffer as the first gradient, 0 x m + g:
            for a in self.anchors:  # the same bits, and a key for a checkpoint to load into
                self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        self.steps = 0  # inner steps done
        self.counts = [0.0] * keys.fragments  # this island's count since each fragment synced
        self.exchanges: dict[int, _Exchange] = {}
        self.bytes_sent = 0
        self.sent = _Sent(self)

    # ----------------------------------------------------------------- the schedule

    def syncs_at(self, fragment: int, step: int) -> bool:
        """Fragment `fragment` starts an exchange after inner step `step` (counted from 1)."""
        h = self.keys.sync_every
        return (step - fragment * h // self.keys.fragments) % h == 0

    def step(self, count: float, *, last: bool) -> None:
        """After an inner optimizer step that trained on `count` examples or tokens (the
        island's): land outer updates that are due, start the exchanges this step begins.
        `last`: the run's final step, where every fragment syncs and lands at once."""
        self.steps += 1
        t, tau = self.steps, self.keys.overlap_steps
        self.counts = [c + count for c in self.counts]
        for f in sorted(self.exchanges):
            if last or self.exchanges[f].due == t:
                self._land(f)
        for f in range(self.keys.fragments):
            if last or self.syncs_at(f, t):
                overlap = tau > 0 and not last
                self._start(f, due=t + tau if overlap else t, mix=overlap)
                if not overlap:
                    self._land(f)

    # ----------------------------------------------------------------- the exchange

    def _start(self, f: int, *, due: int, mix: bool) -> None:
        """Pseudo-gradient of fragment f (anchor - parameters, this rank's shards), sent."""
        members, fmt = self.members[f], self.keys.quantize
        weight, self.counts[f] = self.counts[f], 0.0
        with torch.no_grad():
            flat = torch.cat(
                [(self.anchors[i] - _local(self.params[i])).reshape(-1) for i in members]
                or [torch.zeros(0)]
            )
        flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
        work, numel = None, flat.numel()
        if numel == 0:  # this stage holds none of the fragment (nor do its peers)
            buffer = flat
        elif fmt == "none":
            buffer = flat
            if self.islands > 1:
                if not self.equal_counts:
                    buffer = torch.cat([flat * weight, flat.new_tensor([weight])])
                work = dist.all_reduce(buffer, group=self.group, async_op=True)
                self.bytes_sent += buffer.numel() * buffer.element_size()
        else:
            buffer = encode(flat, fmt=fmt, block=self.keys.quantize_block, weight=weight)
            if self.islands > 1:
                payload, buffer = buffer, buffer.new_empty(self.islands * buffer.numel())
                work = dist.all_gather_single(buffer, payload, group=self.group, async_op=True)
                self.bytes_sent += payload.numel()
        self.exchanges[f] = _Exchange(work, buffer, numel, due, mix)

    def _settle(self, f: int) -> None:
        """Wait for fragment f's exchange and take the outer step on its anchors."""
        ex = self.exchanges[f]
        if ex.settled:
            return
        if ex.work is not None:
            ex.work.wait()
        members = self.members[f]
        if ex.numel:
            average = self._average(ex)
            offset = 0
            for i in members:
                a = self.anchors[i]
                a.grad = average[offset : offset + a.numel()].view_as(a).to(a.dtype)
                offset += a.numel()
            self.outer.step()  # steps only the anchors with a gradient: this fragment's
            for i in members:
                self.anchors[i].grad = None
        ex.work, ex.buffer, ex.settled = None, None, True

    def _average(self, ex: _Exchange) -> torch.Tensor:
        """The islands' pseudo-gradients, weighted by their counts (FedAvg)."""
        fmt, buffer = self.keys.quantize, ex.buffer
        if fmt == "none":
            if self.islands == 1:
                return buffer
            if self.equal_counts:
                return buffer / self.islands
            total = buffer[-1]
            return buffer[:-1] / (total if total > 0 else 1.0)
        dtype = torch.promote_types(self.anchors[0].dtype, torch.float32)
        total, weighted = 0.0, buffer.new_zeros(ex.numel, dtype=dtype)
        for payload in buffer.view(self.islands, -1):  # island order: the same sum everywhere
            x, w = decode(
                payload, fmt=fmt, block=self.keys.quantize_block, numel=ex.numel, dtype=dtype
            )
            if self.islands == 1:  # no weighting: one process's values, unrounded
                return x
            weighted.add_(x, alpha=w)
            total += w
        return weighted / (total if total > 0 else 1.0)

    def _land(self, f: int) -> None:
        """Fragment f's outer update into the parameters: copied in, or (an overlapped
        exchange) mixed with what the island trained meanwhile."""
        self._settle(f)
        ex, alpha = self.exchanges.pop(f), self.keys.overlap_alpha
        with torch.no_grad():
            for i in self.members[f]:
                local = _local(self.params[i])
                if ex.mix:
                    local.mul_(alpha).add_(self.anchors[i], alpha=1 - alpha)
                else:
                    local.copy_(self.anchors[i])

    # ----------------------------------------------------------------- checkpoints

    def _saved(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, parameter, anchor) of every parameter this rank holds."""
        return zip(self.names, self.params, self.anchors)

    def state_dict(self) -> dict:
        for f in sorted(self.exchanges):  # in flight: finish it now (the same bits)
            self._settle(f)
        pending = [self.exchanges.get(f) for f in range(self.keys.fragments)]
        state = {
            "steps": torch.tensor(self.steps),
            # per fragment: the step its settled outer update lands at (-1: none), and how
            "due": torch.tensor([-1 if ex is None else ex.due for ex in pending]),
            "mix": torch.tensor([0 if ex is None else int(ex.mix) for ex in pending]),
            "anchor": {n: _as_saved(p, a) for n, p, a in self._saved()},
            f"island{self.island}": {"counts": torch.tensor(self.counts, dtype=torch.float64)},
        }
        if self.keys.outer_momentum > 0:
            buffers = self.outer.state
            state["momentum"] = {
                n: _as_saved(p, buffers[a]["momentum_buffer"]) for n, p, a in self._saved()
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for n, _, a in self._saved():
                a.copy_(_local(state["anchor"][n]))
                if self.keys.outer_momentum > 0:
                    self.outer.state[a]["momentum_buffer"].copy_(_local(state["momentum"][n]))
        self.steps = int(state["steps"])
        self.counts = [float(c) for c in state[f"island{self.island}"]["counts"]]
        self.exchanges = {
            f: _Exchange(None, None, 0, int(d), bool(m), settled=True)
            for f, (d, m) in enumerate(zip(state["due"].tolist(), state["mix"].tolist()))
            if d >= 0
        }


class _Sent:
    """The per-rank part of DiLoCo's checkpoint: bytes this rank has sent (shards differ)."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    def state_dict(self) -> dict:
        return {"bytes_sent": torch.tensor(self.diloco.bytes_sent)}

    def load_state_dict(self, state: dict) -> None:
        self.diloco.bytes_sent = int(state["bytes_sent"])


def island_groups(layout, mesh) -> tuple[object | None, object | None]:
    """(the island's own data-parallel group, the group across islands): dp_shard's and
    dp_replicate's process groups, None where the degree is 1."""
    inner = mesh["dp_shard"].get_group() if layout.dp_shard > 1 else None
    across = mesh["dp_replicate"].get_group() if layout.dp_replicate > 1 else None
    return inner, across
