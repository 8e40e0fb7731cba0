"""Data, model and loss from the config: the three things a user may bring.

Each of `data.source`, `model.name` and `train.loss` is a built-in name or the user's own
code, named by an import path in the config or, from the Python API, given as the
callable itself (`UserCode`). The trainer builds them here on every rank; the launcher
calls `check_user_code` before any worker starts, so that a factory that does not import,
raises, returns something other than an nn.Module, a dataset whose items do not fit the
model, or a loss that returns a mean is one message (exit status 2), not a failure on
every rank a minute later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from scaletrain.config import Config
from scaletrain.data.loader import Dataset, load_dataset
from scaletrain.data.sources import Batch
from scaletrain.errors import UserError
from scaletrain.loss import LossFn, builtin_loss, check_summed
from scaletrain.models import build_model
from scaletrain.precision import Precision
from scaletrain.user_code import UserCodeError, is_import_path, load_object


@dataclass(frozen=True)
class UserCode:
    """Callables given to the Python API in place of the config's import paths."""

    model: Callable[..., torch.nn.Module] | None = None  # factory(task, **model.kwargs)
    data: Callable[..., Any] | None = None  # function(split, **data.kwargs) -> (dataset, task)
    loss: Callable[..., Any] | None = None  # loss(output, batch) -> (summed loss, count)


NO_CODE = UserCode()


def brings_own_code(config: Config, code: UserCode = NO_CODE) -> bool:
    """True when the model, data or loss is the user's (or a Hugging Face model), or a teacher
    is distilled from: all are built and run once in the launcher first."""
    return (
        code != NO_CODE
        or config.model.name == "hf"
        or is_import_path(config.model.name)
        or bool(config.distill.teacher or config.distill.cache)
        or is_import_path(config.data.source)
        or is_import_path(config.train.loss)
    )


def build_data(config: Config, *, split: str, code: UserCode = NO_CODE) -> Dataset:
    """One split of the configured data source."""
    from scaletrain.distill.build import sentence_tokenizer_dir

    d = config.data
    return load_dataset(
        d.source,
        split=split,
        path=d.path,
        seq_len=d.seq_len,
        synthetic_examples=d.synthetic_examples,
        seed=config.train.seed,
        shuffle_window=d.shuffle_window if split == "train" else None,
        kwargs=d.kwargs,
        fn=code.data,
        tokenizer_dir=sentence_tokenizer_dir(config),
    )


def build_net(
    config: Config, dataset: Dataset, *, code: UserCode = NO_CODE, meta: bool = False
) -> torch.nn.Module:
    """The configured model, sized for the data's task, initialised from train.seed by
    models/init.py's module rule (or whole from the global RNG where a model cannot be
    built on the meta device). `meta`: leave it unmaterialised where it can be."""
    m = config.model
    dtype = torch.float64 if config.precision.mode == "fp64" else torch.float32
    return build_model(
        m.name,
        size=m.size,
        task=dataset.spec,
        dropout=m.dropout,
        kwargs=m.kwargs,
        path=m.path,
        hf_config=m.hf_config,
        factory=code.model,
        param_dtype=dtype,
        seed=config.train.seed,
        meta=meta,
    )


def build_loss(config: Config, dataset: Dataset, *, code: UserCode = NO_CODE) -> LossFn:
    """The configured loss: built-in for the task, or the user's."""
    name = config.train.loss
    if code.loss is not None:
        return code.loss
    if is_import_path(name):
        return load_object(name, key="train.loss")
    try:
        return builtin_loss(name, task_kind=dataset.spec.kind)
    except UserError as e:  # LossError: a loss that does not fit the data's task
        raise UserCodeError(str(e)) from None


def build_objective(
    config: Config,
    net: torch.nn.Module,
    dataset: Dataset,
    *,
    precision: Precision,
    code: UserCode = NO_CODE,
    teacher_meta: bool = False,
):
    """The model the trainer trains and its loss: (net, configured loss, None), or under
    [distill] the student wrapped with its projections, the distillation loss and the
    `Distillation` (distill/build.py). `teacher_meta`: the teacher on the meta device, read
    in slices when it is placed (build_distillation)."""
    from scaletrain.distill.build import build_distillation, distilling

    hard = None if dataset.spec.kind == "encode" else build_loss(config, dataset, code=code)
    if not distilling(config):
        if hard is None:
            raise UserCodeError(
                f"data.source = {config.data.source!r} gives sentences without "
                "labels (kind 'encode'): they train a student from a teacher, "
                "so set distill.teacher (docs/distillation.md)"
            )
        return net, hard, None
    cache_info = None
    if config.distill.cache:
        from scaletrain.distill.cache import read_info

        cache_info = read_info(config.distill.cache)
    kd = build_distillation(
        config,
        net,
        task=dataset.spec,
        hard=hard,
        precision=precision,
        cache_info=cache_info,
        teacher_meta=teacher_meta,
    )
    return kd.model, kd.loss_fn, kd


def is_user_loss(config: Config, code: UserCode = NO_CODE) -> bool:
    return code.loss is not None or is_import_path(config.train.loss)


def check_loss(
    loss_fn: LossFn,
    model: torch.nn.Module,
    batch: Batch,
    *,
    config: Config,
    precision: Precision,
    task_kind: str,
) -> None:
    """The user's loss returns (sum, count) on this batch: `train.loss.check_summed`."""
    from scaletrain.training.step import forward

    def run(net: torch.nn.Module, b: Batch) -> Any:
        with precision.forward_context():
            return forward(net, b, precision)

    try:
        check_summed(
            loss_fn,
            model,
            batch,
            task_kind=task_kind,
            forward=run,
            label=f"train.loss = {config.train.loss!r}",
        )
    except UserCodeError:
        raise
    except UserError as e:  # LossError: not (sum, count), or a mean
        raise UserCodeError(str(e)) from None


# Above this many bytes of parameters and buffers the launcher checks the model on the meta
# device (shapes and dtypes through the forward and a built-in loss), not on real weights:
# building and initialising them would cost the launcher the whole model's memory and
# seconds per GiB. The workers then run the full check, the user's loss included, on their
# shards before the first step (training/trainer.py).
CHECK_ON_META_BYTES = 256 * 2**20


def check_user_code(config: Config, code: UserCode = NO_CODE) -> None:
    """Build the data, the model and the loss once in this process and run the model and
    the loss on two training examples: what a worker would do first, without a process
    group. A model above CHECK_ON_META_BYTES (under [distill], the student's bytes and the
    teacher's weight files') is checked on the meta device, the teacher with it; with
    distill.init_layers, which copies teacher values into the student, on real weights.

    Raises:
        UserCodeError: naming the config key, the path and what went wrong.
    """
    from scaletrain.distill.teacher import weight_file_bytes
    from scaletrain.models.init import is_meta
    from scaletrain.models.protocol import model_spec
    from scaletrain.precision import make_precision

    d = config.distill
    torch.manual_seed(config.train.seed)
    train_ds = build_data(config, split="train", code=code)
    eval_ds = build_data(config, split="eval", code=code)  # the eval split must exist and check too
    model = build_net(config, train_ds, code=code, meta=not d.init_layers)
    # A run from a cache loads no teacher (init_layers, which would, is checked real anyway).
    teacher_bytes = weight_file_bytes(d.teacher) if d.teacher and not d.cache else 0
    on_meta = is_meta(model) and tensor_bytes(model) + teacher_bytes > CHECK_ON_META_BYTES
    if is_meta(model) and not on_meta:  # small: real weights, the user's loss checked here
        model = build_net(config, train_ds, code=code)
    try:
        model_spec(model)
    except UserError as e:  # ModelSpecError
        raise UserCodeError(f"model.name = {config.model.name!r}: {e}") from None
    precision = make_precision(
        config.precision.mode,
        device_type="cpu",
        init_scale=config.precision.init_scale,
        growth_interval=config.precision.growth_interval,
    )
    model, loss_fn, kd = build_objective(
        config, model, train_ds, precision=precision, code=code, teacher_meta=on_meta
    )
    if on_meta and kd is not None and kd.teacher is not None:
        kd.teacher.module.to("meta")  # a checkpoint teacher is loaded whole: its shapes only
    if config.distill.cache:  # checked against the data and teacher before any worker starts
        from scaletrain.distill.build import cached_splits

        train_ds = cached_splits(
            config, kd, precision=precision, splits={"train": train_ds, "eval": eval_ds}
        )["train"]
    model = precision.convert_module(model)
    batch = train_ds.get(torch.arange(min(2, len(train_ds))))
    if on_meta:  # shapes only; a user's loss may need values: the workers check it
        try:
            check_fit(
                model,
                batch.to("meta"),
                loss_fn=None if is_user_loss(config, code) else loss_fn,
                precision=precision,
                config=config,
            )
        except UserCodeError as e:
            if "meta" not in str(e.__cause__):
                raise
            # The forward reads a value somewhere (`.item()`, a data-dependent shape): the
            # meta device cannot run it, and the workers check it on their shards.
        return
    check_fit(model, batch, loss_fn=loss_fn, precision=precision, config=config)
    if is_user_loss(config, code):
        check_loss(
            loss_fn, model, batch, config=config, precision=precision, task_kind=train_ds.spec.kind
        )


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (their global shapes; meta included)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def check_fit(
    model: torch.nn.Module,
    batch: Batch,
    *,
    loss_fn: LossFn | None,
    precision: Precision,
    config: Config,
) -> None:
    """One forward and loss on `batch`: a dataset whose items do not fit the model fails here
    with the model, the data and the shapes named, instead of inside a worker's step (no
    loss when `loss_fn` is None)."""
    from scaletrain.training.step import forward
    from scaletrain.user_code import describe_error

    with torch.no_grad(), precision.forward_context():
        try:
            output = forward(model, batch, precision)
        except Exception as e:
            raise UserCodeError(
                f"model.name = {config.model.name!r} cannot run on data.source = "
                f"{config.data.source!r}: a batch of inputs {tuple(batch.inputs.shape)} "
                f"{batch.inputs.dtype} raised {describe_error(e)}"
            ) from e
        try:
            if loss_fn is not None:
                loss_fn(output, batch)
        except Exception as e:
            raise UserCodeError(
                f"train.loss = {config.train.loss!r} cannot compare the output of model.name = "
                f"{config.model.name!r} with the targets {tuple(batch.targets.shape)} "
                f"{batch.targets.dtype} of data.source = {config.data.source!r}: "
                f"{describe_error(e)}"
            ) from e


def measure_attention(
    model: torch.nn.Module,
    dataset: Dataset,
    first: torch.Tensor,
    *,
    precision: Precision,
    micro_batch: int,
) -> tuple[str | None, dict[str, float]]:
    """The SDPA backend fastest for `model`'s own attention calls in `precision` on this CPU
    (runtime/attention.py), and each candidate's seconds for a micro-batch of them; (None, {}) on
    a GPU, in float64 (which proves numerics: torch's choice, the same everywhere), for a
    model without attention, or one whose forward cannot be traced here (a meta-built
    model whose forward reads values). `first`: this rank's first micro-batch's indices,
    of which two examples are run (no gradient) to record the calls."""
    import copy

    from torch._subclasses.fake_tensor import FakeTensorMode

    from scaletrain.models.init import is_meta
    from scaletrain.runtime.attention import fastest_backend, record_calls
    from scaletrain.training.step import forward

    on_meta = is_meta(model)
    device = torch.device("cpu") if on_meta else next(iter(model.parameters())).device
    if device.type != "cpu" or precision.param_dtype == torch.float64:
        return None, {}
    sample = dataset.get(first[:2])
    recorded = len(first[:2])

    def run(net: torch.nn.Module) -> None:
        with precision.forward_context():
            forward(net, sample, precision)

    if not on_meta:
        calls = record_calls(lambda: run(model))
    else:  # a copy in fake CPU tensors: shapes, and the dtypes CPU autocast gives them
        try:
            probe = copy.deepcopy(model)  # outside the fake mode: inside, it cannot swap
            with FakeTensorMode(allow_non_fake_inputs=True):
                probe.to_empty(device="cpu")
                calls = record_calls(lambda: run(probe))
        except Exception:  # noqa: BLE001  only a measurement: torch's choice stands
            return None, {}
    return fastest_backend([c.widened(micro_batch, recorded) for c in calls])
