"""Initialisation that does not depend on the layout: a model built on the meta device, each
rank materialising only its shards, and every shard holding what one process would hold.

Why not simply initialise after sharding: each rank would draw its shard from its own RNG
stream (DTensor's offset RNG is CUDA-only, and on CPU every rank draws the same values
into different shards), so the weights would depend on the layout and no layout could
reproduce one process. Why not build the whole model and shard it: every rank would then
hold the whole model once, the very memory sharding exists to save.

The rule (`materialize`): for every module that holds parameters or buffers of its own, in
`named_modules` order,
1. a full-size stand-in of each of its tensors is made on the CPU (float32 for floating
   tensors, filled with NaN so that a tensor the init leaves unset is caught);
2. torch's global RNG is seeded from (the run's seed, the module's name) alone, inside
   `fork_rng`, and the module's initialiser fills the stand-ins;
3. each rank copies its slice of each stand-in into its shard (DTensor placements decide
   the slice) or the whole of it into a plain tensor, casting to the tensor's dtype.
The values then depend on the seed and the module's name only: one process, dp, dp_shard,
tp, pp and their compositions hold the same bits, and peak memory is one module's full
tensors, not the model's.

Who initialises a module (`init_plan`): its nearest ancestor-or-self that declares how
1. `init_module(name, module)`, a method of the model (or of any module above the one being
   initialised): the built-in models and the distillation wrapper define it, and a user
   model opts in by defining it. It must set every parameter and buffer that `module`
   holds itself (not its children's), drawing from torch's global RNG, and nothing else;
2. a Hugging Face `PreTrainedModel`: its own `_init_weights(module)`, which is what
   `from_config` runs (the rotary embeddings' buffers included).
A model with a module that holds tensors and has no such ancestor (a user model that
initialises in `__init__` only) cannot be built on meta: scaletrain builds it whole, from
the global RNG as before, and says what that costs when the layout splits it.

A wrapper that holds a whole model as a child (distillation's `Distilled` holds the student
beside its projections) names that child in `init_scopes`: the child's modules draw under the
names they have in the child alone (`draw_name`), so a model starts from the same values
wrapped or not (a student distilled with alpha = 0 is the run without [distill]).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.user_code import UserCodeError

INIT_ATTR = "init_module"
WEIGHTS_ATTR = "scaletrain_weights"  # on a meta-built model: its pretrained WeightFiles
SCOPES_ATTR = "init_scopes"  # on a wrapper: children whose modules draw as in the child alone

Initialiser = Callable[[str, nn.Module], None]


class ModelInitError(UserCodeError):
    """A module's initialiser left one of its tensors unset (still NaN), or a weights file
    holds a tensor of another shape: one line, as any mistake in the user's model."""


def init_plan(model: nn.Module) -> dict[str, Initialiser] | None:
    """For every module holding tensors of its own, the initialiser that sets them; None
    when one has none (the model must then be built for real).

    Args:
        model: the bare model, on any device (meta included), not yet split.
    """
    owner: dict[str, Initialiser | None] = {}
    plan: dict[str, Initialiser] = {}
    for name, module in model.named_modules():
        parent = owner.get(name.rpartition(".")[0]) if name else None
        owner[name] = _declared(module) or parent
        if not _own_tensors(module):
            continue
        if owner[name] is None:
            return None
        plan[name] = owner[name]
    return plan


def undeclared(model: nn.Module) -> list[str]:
    """Names of the modules holding tensors that no initialiser covers (for messages)."""
    owner: dict[str, bool] = {}
    missing = []
    for name, module in model.named_modules():
        parent = owner.get(name.rpartition(".")[0], False) if name else False
        owner[name] = _declared(module) is not None or parent
        if _own_tensors(module) and not owner[name]:
            missing.append(name or "(the root module)")
    return missing


def is_meta(model: nn.Module) -> bool:
    """True when the model's tensors are on the meta device (not yet materialised)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def module_seed(seed: int, name: str) -> int:
    """The seed of one module's draw: from the run's seed and the module's name only."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize(
    parts: Sequence[nn.Module],
    *,
    plan: dict[str, Initialiser],
    seed: int,
    device: torch.device,
    weights: WeightFiles | None = None,
) -> int:
    """Allocate the meta-built `parts` on `device` (this rank's shards only) and fill them:
    a tensor that `weights` holds is read from its file, this rank's slice only; any other
    is initialised by the module rule. The same values for a tensor whatever the layout.

    Args:
        parts: this rank's modules, names as in the bare model (the whole model, or its
            pipeline stages), already split by TP and FSDP where the layout does.
        plan: `init_plan` of the bare model.
        seed: train.seed.
        device: this rank's device.
        weights: pretrained weights to read in slices (a Hugging Face directory's
            safetensors), or None to initialise everything.

    Returns:
        The bytes read from `weights` (0 without).
    """
    from safetensors import safe_open

    filled: set[int] = set()  # tensors already set (a tied weight is held by two modules)
    for part in parts:
        ties = _tied(part)
        part.to_empty(device=device)
        _retie(part, ties)
    read, opened, scopes = 0, {}, _scopes(parts)
    with torch.no_grad(), contextlib.ExitStack() as files:
        for part in parts:
            for name, module in part.named_modules():
                name = _bare_name(name)
                own = {
                    attr: t
                    for attr, t in (*_live(module._parameters), *_live(module._buffers))
                    if id(t) not in filled
                }
                from_file = {
                    a: t for a, t in own.items() if weights and _join(name, a) in weights.names
                }
                for attr, target in from_file.items():
                    path = weights.files[_join(name, attr)][0]
                    if path not in opened:
                        opened[path] = files.enter_context(safe_open(str(path), framework="pt"))
                    read += weights.read_into(target, _join(name, attr), opened=opened)
                rest = {a: t for a, t in own.items() if a not in from_file}
                if rest:
                    full = draw(draw_name(name, scopes), module, init=plan[name], seed=seed)
                    for attr, target in rest.items():
                        copy_slice(target, full[attr])
                filled.update(id(t) for t in own.values())
    return read


def initial_values(
    model: nn.Module, names: Sequence[str], *, plan: dict[str, Initialiser], seed: int
) -> dict[str, torch.Tensor]:
    """The initial values of some of a meta-built model's parameters (full tensors, on the
    CPU, in each parameter's dtype): what `materialize` gives them, drawn one module at a
    time, without materialising the rest. A parameter server holds only its partition.

    Args:
        model: the bare model on the meta device.
        names: parameter names as `named_parameters` gives them (a tied weight under the
            first module that holds it, which is the one `materialize` draws it in).
        plan, seed: as for `materialize`.
    """
    by_module: dict[str, list[str]] = {}
    for full in names:
        module, _, attr = full.rpartition(".")
        by_module.setdefault(module, []).append(attr)
    out, scopes = {}, _scopes([model])
    for module_name, attrs in by_module.items():
        module = model.get_submodule(module_name)
        values = draw(draw_name(module_name, scopes), module, init=plan[module_name], seed=seed)
        for attr in attrs:
            like = module._parameters[attr]
            out[_join(module_name, attr)] = values[attr].to(like.dtype)
    return out


def draw(name: str, module: nn.Module, *, init: Initialiser, seed: int) -> dict[str, torch.Tensor]:
    """The full values of `module`'s own tensors: its initialiser run on CPU stand-ins of
    their global shapes, under a seed of its own. A tensor the initialiser leaves unset is
    refused by name: a floating one is still NaN; an integer or bool one (a position table,
    a mask) holds no NaN, so the initialiser runs again on stand-ins of another fill, and
    one that follows the fill was not set (built for real it would have held its
    constructor's values; on meta those are gone)."""
    out = _run_init(name, module, init=init, seed=seed, fill=0)
    unset = [k for k, v in out.items() if v.is_floating_point() and bool(v.isnan().any())]
    exact = [k for k, v in out.items() if not v.is_floating_point()]
    if exact:
        again = _run_init(name, module, init=init, seed=seed, fill=1)
        unset += [k for k in exact if not torch.equal(out[k], again[k])]
    if unset:
        raise ModelInitError(
            f"the initialiser of module {name or '(root)'!r} ({type(module).__name__}) left "
            f"{', '.join(unset)} unset: an `{INIT_ATTR}(name, module)` must set every "
            "parameter and buffer the module holds itself, integer and bool buffers "
            "included (docs/ARCHITECTURE.md, 'Models bigger than one device')"
        )
    return out


def _run_init(
    name: str, module: nn.Module, *, init: Initialiser, seed: int, fill: int
) -> dict[str, torch.Tensor]:
    """`init(name, module)` with the module's tensors swapped for stand-ins (`_stand_in`)
    while it runs and put back after; the stand-ins' values."""
    params, buffers = module._parameters, module._buffers
    stand_params = {
        k: nn.Parameter(_stand_in(v, fill=fill), requires_grad=False) for k, v in _live(params)
    }
    stand_buffers = {k: _stand_in(v, fill=fill) for k, v in _live(buffers)}
    module.__dict__["_parameters"] = {**params, **stand_params}
    module.__dict__["_buffers"] = {**buffers, **stand_buffers}
    try:
        with torch.random.fork_rng(devices=[]):
            # The CPU generator alone, where the stand-ins are drawn: what torch.manual_seed
            # seeds for them, without its per-call queueing of other devices' seeds.
            torch.default_generator.manual_seed(module_seed(seed, name))
            init(name, module)
        out = {k: module._parameters[k].detach() for k in stand_params}
        out.update({k: module._buffers[k] for k in stand_buffers})
    finally:
        module.__dict__["_parameters"], module.__dict__["_buffers"] = params, buffers
    return out


def draw_name(name: str, scopes: Sequence[str]) -> str:
    """The name a module draws under (its seed's name): its name in the innermost scope
    (`init_scopes`) that holds it, or its name in the model.

    Args:
        name: the module's name in the bare model.
        scopes: the scopes' names in the bare model, longest first (`_scopes`).
    """
    for scope in scopes:
        if name == scope or name.startswith(f"{scope}."):
            return name[len(scope) + 1 :]
    return name


def _scopes(parts: Sequence[nn.Module]) -> list[str]:
    """The names of the children that wrappers declare in `init_scopes`, longest first."""
    found = {
        _join(_bare_name(name), child)
        for part in parts
        for name, module in part.named_modules()
        for child in getattr(module, SCOPES_ATTR, ())
    }
    return sorted(found, key=len, reverse=True)


def reset_parameters(name: str, module: nn.Module) -> None:
    """torch's own default init of a module (`reset_parameters`): what the built-in MLP
    and CNN use, as an `init_module`."""
    module.reset_parameters()


def _join(module: str, attr: str) -> str:
    return f"{module}.{attr}" if module else attr


def _bare_name(name: str) -> str:
    """The module's name in the bare model: activation checkpointing's wrapper adds a
    `_checkpoint_wrapped_module` level (which state dicts drop too)."""
    return ".".join(p for p in name.split(".") if p != "_checkpoint_wrapped_module")


def _declared(module: nn.Module) -> Initialiser | None:
    own = getattr(module, INIT_ATTR, None)
    if callable(own):
        return own
    if "transformers" in sys.modules:  # never import transformers just to ask
        from transformers import PreTrainedModel

        if isinstance(module, PreTrainedModel):
            return lambda name, m, hf=module: hf._init_weights(m)
    return None


def _own_tensors(module: nn.Module) -> bool:
    return any(True for _ in _live(module._parameters)) or any(True for _ in _live(module._buffers))


def _live(tensors: dict) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for k, v in tensors.items() if v is not None]


def _stand_in(like: torch.Tensor, *, fill: int) -> torch.Tensor:
    """A CPU tensor of `like`'s global shape: float32 NaN for a floating tensor (drawn in
    float32 whatever the master dtype, so fp32 and fp64 runs start from the same values),
    `fill` in its own dtype otherwise."""
    if like.is_floating_point():
        return torch.full(tuple(like.shape), float("nan"), dtype=torch.float32, device="cpu")
    return torch.full(tuple(like.shape), fill, dtype=like.dtype, device="cpu")


def copy_slice(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into `target`: the slice a DTensor's placements
    give this rank (computed on the CPU, so the full tensor never reaches the device), or
    all of it."""
    _local(target).copy_(full[local_index(target)])


def local_index(target: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the global tensor that this rank holds of `target` (all of a plain
    tensor; a DTensor's local shard, FSDP's and TP's placements together)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _local(target: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return target.to_local() if isinstance(target, DTensor) else target


@dataclass(frozen=True)
class WeightFiles:
    """Pretrained weights in safetensors files, read a rank's slice at a time.

    `files`: tensor name in the model -> (file, the name it has in that file)."""

    files: dict[str, tuple[Path, str]]

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def read_into(self, target: torch.Tensor, name: str, *, opened: dict[Path, Any]) -> int:
        """Read this rank's slice of `name` into `target` (cast to its dtype); the bytes read.
        `opened`: the files opened so far (safetensors' `safe_open`), reused."""
        path, key = self.files[name]
        piece = opened[path].get_slice(key)
        if tuple(piece.get_shape()) != tuple(target.shape):
            raise ModelInitError(
                f"{path.name}: {key} has shape {tuple(piece.get_shape())}, the model's "
                f"{name} {tuple(target.shape)}"
            )
        value = piece[local_index(target)] if target.dim() else piece[...]
        _local(target).copy_(value)
        return value.numel() * value.element_size()


def _tied(model: nn.Module) -> list[tuple[str, str, str, str]]:
    """Parameters held by two modules (tied embeddings): (module, attr, source module,
    source attr). `to_empty` gives each holder a tensor of its own; `_retie` joins them."""
    seen: dict[int, tuple[str, str]] = {}
    ties = []
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, param in _live(module._parameters):
            if id(param) in seen and seen[id(param)] != (mname, attr):
                ties.append((mname, attr, *seen[id(param)]))
            seen.setdefault(id(param), (mname, attr))
    return ties


def _retie(model: nn.Module, ties: list[tuple[str, str, str, str]]) -> None:
    for mname, attr, src, src_attr in ties:
        setattr(model.get_submodule(mname), attr, getattr(model.get_submodule(src), src_attr))
