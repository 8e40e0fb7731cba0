"""What each parameter-server role builds: the model from train.seed (every role alike, so
frozen parameters and buffers agree), a server's partition of it and its shard module."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from scaletrain.config import Config
from scaletrain.data.loader import Dataset
from scaletrain.launch.resolve import Derived
from scaletrain.loss import LossFn
from scaletrain.precision import Precision
from scaletrain.ps.partition import model_partition
from scaletrain.records.memory import global_bytes
from scaletrain.training.progress import Startup


class AllWorkersDead(RuntimeError):
    """The servers outlived every worker: the run has no result to speak of."""


def eval_data(config: Config):
    from scaletrain.training.assemble import build_data

    return build_data(config, split="eval")


def fresh_net(
    config: Config, dataset: Dataset, precision: Precision, *, meta: bool = False
) -> torch.nn.Module:
    """The model as every role builds it, train.seed set just before: a model that cannot
    be built on meta draws its initial values from the global RNG (a user model's frozen
    parameters and random buffers included, which no server holds), so a worker, a server
    and server 0's gathered model get the same ones whatever each did with the RNG first."""
    from scaletrain.runtime import seed_everything
    from scaletrain.training.assemble import build_net

    seed_everything(config.train.seed)
    return precision.convert_module(build_net(config, dataset, meta=meta))


def role_model(config: Config, derived: Derived):
    """Model, precision, train set: identical on every rank (same seed)."""
    from scaletrain.precision import make_precision
    from scaletrain.runtime import seed_everything
    from scaletrain.training.assemble import build_data, build_loss

    seed_everything(config.train.seed)  # a user's data may draw from the global RNG
    train_ds = build_data(config, split="train")
    precision = make_precision(config.precision.mode, device_type="cpu")
    model = fresh_net(config, train_ds, precision)
    return model, precision, train_ds, build_loss(config, train_ds)


@dataclass(frozen=True)
class ServerPart:
    """What one server holds."""

    eval_ds: Dataset  # the held-out set: its task, and server 0's evaluations
    precision: Precision
    loss_fn: LossFn
    params: dict[str, torch.nn.Parameter]  # its partition, at the workers' initial values
    hidden: frozenset[str] | None = None  # muon: the matrices Muon takes (training/optimizers.py)


def server_part(config: Config, derived: Derived, *, index: int, startup: Startup) -> ServerPart:
    """What server `index` holds. The model is built on the meta device and only the
    partition is drawn (models/init.py's module rule, the values the workers' whole
    builds get); a model that cannot be built on meta is built whole and all but the
    partition dropped. No server reads the training set."""
    from scaletrain.models.init import init_plan, initial_values, is_meta
    from scaletrain.precision import make_precision
    from scaletrain.training.assemble import build_loss
    from scaletrain.training.optimizers import hidden_matrices

    eval_ds = eval_data(config)
    startup.say(
        f"data: {len(eval_ds)} evaluation examples on server 0, the training set on the "
        f"workers (data.source = {config.data.source!r})"
    )
    precision = make_precision(config.precision.mode, device_type="cpu")
    model = fresh_net(config, eval_ds, precision, meta=True)
    names = model_partition(model, servers=derived.ps.servers)[index]
    if is_meta(model):
        values = initial_values(model, names, plan=init_plan(model), seed=config.train.seed)
        params = {n: torch.nn.Parameter(v) for n, v in values.items()}
    else:
        whole = dict(model.named_parameters())
        params = {n: whole[n] for n in names}
    shape, mode = derived.ps, config.ps.mode
    startup.say(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters (model.name = "
        f"{config.model.name!r}, {'built on meta' if is_meta(model) else 'built whole'}), "
        f"layout {shape.servers} parameter server(s) + {shape.workers} worker(s), "
        f"ps.mode = {mode!r}"
    )
    model_bytes = global_bytes(model.parameters())
    print(  # every server's, in its log (before server 0's progress bar starts)
        f"scaletrain: server {index} holds {len(params)} parameter tensor(s), "
        f"{_mib(global_bytes(params.values()))} of the model's {_mib(model_bytes)}",
        file=sys.stderr,
        flush=True,
    )
    return ServerPart(
        eval_ds=eval_ds,
        precision=precision,
        loss_fn=build_loss(config, eval_ds),
        params=params,
        hidden=frozenset(hidden_matrices(model)) if config.optim.name == "muon" else None,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def shard_module(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module holding exactly these parameters under their dotted names (nested plain
    modules), so that the checkpoint code keys them as the whole model does."""
    root = torch.nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, p)
    return root
