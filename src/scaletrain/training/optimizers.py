"""The optimizers torch's constructors alone do not make: Muon beside AdamW as one
Optimizer, and a step on whole tensors for those that cannot step on shards.

Muon orthogonalises each update matrix (Newton-Schulz), which only means something for the
2-D weights of hidden layers. `MuonWithAdamW` is torch's Muon on the matrices inside the
model's repeated blocks (`hidden_matrices`) and torch's AdamW (optim.lr, betas,
weight_decay) on the rest - embeddings, the output head, norms, biases - as Keller Jordan's
Muon and Moonlight split them. It is one torch Optimizer, so the train step, the LR
schedule, the fp16 loss scaler and the checkpoint (one state dict keyed by parameter name)
treat it like any other. Both halves share optim.lr, so Muon's learning rate is adjusted
to match AdamW's update size (adjust_lr_fn = "match_rms_adamw", Moonlight's) unless
optim.kwargs says otherwise (training/optim.py).

Under dp_shard and tp the parameters are DTensors. Most of torch's optimizers are
element-wise and run on the shards as they are. Muon's orthogonalisation must see the
whole matrix: run on DTensors as they are, its bf16 norm and matmuls are reduced shard by
shard and round differently from one process's, far beyond float64's noise. Adafactor's
factored moments fail on DTensors outright (in-place ops on partial sums), as Rprop's
masked updates do. These step on whole tensors (`WholeTensorStep`): each sharded
parameter, its gradient and its optimizer state are gathered, torch's own step runs on
them, and each rank keeps its shard of the result - the optimizer computes exactly what it
would in one process (tests/test_optim_parity.py). State of the parameter's shape (Muon's
momentum) stays sharded between steps; Adafactor's row and column moments are kept whole,
as small as a row and a column. The cost: the gathers, and every rank repeats the step.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' segments (DDP's `module.`, torch.compile's
    `_orig_mod.`, activation checkpointing's `_checkpoint_wrapped_module.`), as checkpoints
    name it."""
    wrappers = ("module", "_orig_mod", "_checkpoint_wrapped_module")
    parts = name.split(".")
    while parts and parts[0] in wrappers[:2]:
        parts.pop(0)
    return ".".join(p for p in parts if p != wrappers[2])


def hidden_matrices(model: torch.nn.Module) -> set[str]:
    """The parameters Muon takes, by plain name: the 2-D weights inside the model's
    repeated blocks (its ModelSpec's `blocks`: the GPT's layers, a Hugging Face model's),
    which excludes the embeddings, the output head, norms and biases. A model without
    repeated blocks (mlp, cnn): the weights of its Linear layers but the last (the head).
    Computed on the whole bare model, so every pipeline stage and parameter server splits
    its share alike."""
    from scaletrain.models.protocol import SPEC_ATTR, model_spec

    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP
        model = model.module
    model = getattr(model, "_orig_mod", model)  # torch.compile
    # declared first: a pipeline stage lacks the modules its spec names for the other stages
    blocks = (getattr(model, SPEC_ATTR, None) or model_spec(model)).blocks
    if blocks is not None:
        return {
            plain_name(n)
            for n, p in model.named_parameters()
            if p.ndim == 2 and plain_name(n).startswith(f"{blocks}.")
        }
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return {plain_name(f"{n}.weight") for n in linears[:-1]}


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on the hidden matrices, torch's AdamW on every other parameter: one
    Optimizer over both, so that the schedule, the loss scaler and the checkpoint see one.

    Each parameter group carries `muon` (True or False); `step` hands each inner optimizer
    its groups and the shared state, fresh each time (loading a state dict replaces both).
    """

    def __init__(
        self,
        matrices: list[dict],
        rest: list[dict],
        *,
        muon: dict[str, Any],
        adamw: dict[str, Any],
    ) -> None:
        inner = []
        if any(g["params"] for g in matrices):
            inner.append(whole_tensor_step(torch.optim.Muon)(matrices, **muon))
        if any(g["params"] for g in rest):
            inner.append(torch.optim.AdamW(rest, **adamw))
        groups = []
        for opt in inner:
            for g in opt.param_groups:
                g["muon"] = isinstance(opt, torch.optim.Muon)
                groups.append(g)
        super().__init__(groups, defaults={})
        self._inner = inner

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner:
            is_muon = isinstance(opt, torch.optim.Muon)
            opt.param_groups = [g for g in self.param_groups if g["muon"] is is_muon]
            opt.state = self.state
            opt.step()
        return loss


# --------------------------------------------------------------------------- sharded steps


def whole_tensor_step(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`cls` with its step run on whole tensors where the parameters are DTensors."""
    return type(cls.__name__, (WholeTensorStep, cls), {"wrapped": cls})


class WholeTensorStep:
    """Mixin: the optimizer's own step, run on each sharded parameter as a whole tensor.

    Before the step each DTensor parameter with a gradient is swapped, in its group, for
    its gathered whole tensor carrying the gathered gradient, and its state for the
    gathered state; after it each rank copies its shard of the result back. State of the
    parameter's shape (Muon's momentum, a vector's Adafactor variance) is kept sharded like
    the parameter, anything else (Adafactor's row and column moments, step counts) whole:
    both are what one process would hold, so checkpoints reshard across layouts. Every
    rank computes the whole step: the cost is the gathers and the repeated work.
    """

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        # The planner's pass (planner/trace.py) steps a model of shapes on the meta device,
        # where a step that reads values (Adafactor's .item()) cannot run: there the state
        # is only created, with the shapes and placements a real step gives it.
        meta = any(p.is_meta for group in self.param_groups for p in group["params"])
        swapped = []  # (group's params, index, the DTensor, its whole tensor)
        for group in self.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if not isinstance(p, DTensor) or p.grad is None:
                    continue
                whole = _gathered(p)
                whole.grad = _gathered(p.grad)
                if p in self.state:
                    self.state[whole] = {k: _gathered(v) for k, v in self.state.pop(p).items()}
                params[i] = whole
                swapped.append((params, i, p, whole))
        try:
            if meta:
                return self._create_state()
            return super().step(closure)
        finally:
            for params, i, p, whole in swapped:
                params[i] = p
                if not meta:
                    p.copy_(_shard_like(whole, p))
                state = self.state.pop(whole, None)
                if state is not None:
                    self.state[p] = {
                        k: _shard_like(v, p) if _shaped_like(v, p) else v for k, v in state.items()
                    }

    def _create_state(self) -> None:
        """The state the first step creates, through the optimizer's own `_init_group`
        (torch's optimizers take the group and the lists it fills)."""
        lists = len(inspect.signature(self._init_group).parameters) - 1
        for group in self.param_groups:
            self._init_group(group, *([] for _ in range(lists)))


def _gathered(value: Any) -> Any:
    """A DTensor's whole tensor (on the meta device, an empty one: no collective)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    if value.is_meta:
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value.full_tensor()


def _shaped_like(value: Any, p: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == p.shape


def _shard_like(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `whole`, placed as DTensor `p` is: cut locally, no collective."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
