"""The user's own dataset: `data.source = 'package.module:function'`.

The function is called once per split, as `function(split, **data.kwargs)` with split
"train" or "eval", and returns `(dataset, task)`:
- `dataset` is map-style, as torch's `Dataset` is: `len(dataset)` and `dataset[i]`, where
  an item is `(inputs, target)` or a dict with "inputs" and "targets" (other keys are
  tensors passed to the model's forward as keyword arguments, e.g. attention_mask); a
  dataset with torch's batched `__getitems__(indices)` is read with one call per batch;
- `task` is a `scaletrain.TaskSpec`, or a dict of its fields: kind ("classification",
  "lm" or "regression"), input_shape (of one example) and num_classes.

`MapSource` puts it behind the same `Dataset` face as the built-in sources (`get(indices)`
-> Batch), so the global sampler, per-rank slicing, exact resume and evaluation work on it
unchanged: it is one shard of len(dataset) rows, and a batch is its items stacked, in the
sampler's order. Items are read in the training process (no worker processes); a dataset
whose items are expensive to make should cache them.

What is checked, with the function's path and the item's index named: the return value's
shape, the task, and the first and last item against the task (input shape and dtype,
target range); later items that disagree in shape fail when a batch is stacked, with both
items named. For text ("lm") the target counts are taken to differ between examples (-100
padding), so the step all-reduces its count (one scalar) whatever the task says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from scaletrain.data.sources import IGNORE_INDEX, TASK_KINDS, Batch, TaskSpec, target_count
from scaletrain.user_code import UserCodeError, call, describe_error, load_object


class MapSource:
    """A user's map-style dataset as a scaletrain Dataset (one shard, read item by item)."""

    def __init__(self, dataset: Any, spec: TaskSpec, *, label: str) -> None:
        """Wrap and check a dataset.

        Args:
            dataset: has __len__ and __getitem__ (see the module docstring for the items).
            spec: the task it poses.
            label: how the user named it, e.g. "data.source = 'mydata:load' (split 'train')".
        """
        self.dataset, self.spec, self.label = dataset, spec, label
        self._n = len(dataset)
        if self._n == 0:
            raise UserCodeError(f"{label} returned an empty dataset")
        for i in sorted({0, self._n - 1}):
            self._check_item(i, self._item(i))

    def __len__(self) -> int:
        return self._n

    @property
    def shard_rows(self) -> tuple[int, ...]:
        return (self._n,)

    def prefetch(self, indices: torch.Tensor) -> None:
        """Items are made on demand: nothing to read ahead."""

    def get(self, indices: torch.Tensor) -> Batch:
        """Stack the items at `indices` (in that order) into one Batch.

        Per item only the structure is read; tensors are stacked and their dtype converted
        once per batch (per-item conversion cost more than the user's own __getitem__)."""
        ids = indices.tolist()
        parts = [self._split(raw, i) for raw, i in zip(self._raw(ids), ids)]
        inputs = self._column([p[0] for p in parts], ids, "inputs")  # (B, *input_shape)
        targets = self._column([p[1] for p in parts], ids, "targets")  # (B,) or (B, T)
        extras = {
            k: self._stack([torch.as_tensor(p[2][k]) for p in parts], ids, k) for k in parts[0][2]
        }
        tokens = inputs.numel() if self.spec.kind == "lm" else 0
        return Batch(
            inputs=inputs,
            targets=targets,
            count=target_count(self.spec.kind, targets),
            tokens=tokens,
            extras=extras,
        )

    def _raw(self, ids: list[int]) -> list:
        """The items as the dataset gives them: one `__getitems__(list)` call where the
        dataset has torch's batched-fetch method (as DataLoader uses it), else item by item."""
        try:
            if callable(getattr(self.dataset, "__getitems__", None)):
                items = list(self.dataset.__getitems__(ids))
                if len(items) != len(ids):
                    raise UserCodeError(
                        f"{self.label}: __getitems__ returned {len(items)} items "
                        f"for {len(ids)} indices"
                    )
                return items
            return [self.dataset[i] for i in ids]
        except UserCodeError:
            raise
        except Exception as e:
            raise UserCodeError(
                f"{self.label}: reading items {ids[:8]}"
                f"{'...' if len(ids) > 8 else ''} raised "
                f"{describe_error(e)}"
            ) from e

    def _item(self, i: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Item i as tensors (inputs, targets, extras), for the checks."""
        batch = self.get(torch.tensor([i]))
        return batch.inputs[0], batch.targets[0], batch.extras

    def _split(self, item: Any, i: int) -> tuple[Any, Any, dict[str, Any]]:
        if isinstance(item, dict):
            if "inputs" not in item or "targets" not in item:
                missing = [k for k in ("inputs", "targets") if k not in item]
                raise UserCodeError(
                    f"{self.label}: item {i} is a dict with keys {sorted(item)}; "
                    f"it needs 'inputs' and 'targets' (missing {missing})"
                )
            extras = {k: v for k, v in item.items() if k != "inputs" and k != "targets"}
            return item["inputs"], item["targets"], extras
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return item[0], item[1], {}
        raise UserCodeError(
            f"{self.label}: item {i} is a {type(item).__name__}; an item is "
            "(inputs, target) or a dict with 'inputs' and 'targets'"
        )

    def _column(self, values: list, ids: list[int], what: str) -> torch.Tensor:
        """One field of every item as one tensor, in the dtype the task needs."""
        tensors = []
        for value, i in zip(values, ids):
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                continue
            try:
                tensors.append(torch.as_tensor(value))
            except (TypeError, ValueError, RuntimeError) as e:
                raise UserCodeError(
                    f"{self.label}: item {i}'s {what} ({type(value).__name__}) "
                    f"is not a tensor or numbers: {e}"
                ) from None
        t = self._stack(tensors, ids, what)
        kind = self.spec.kind
        floating = what == "inputs" and kind != "lm" or what == "targets" and kind == "regression"
        if not floating and t.is_floating_point():
            raise UserCodeError(
                f"{self.label}: item {ids[0]}'s {what} are {t.dtype}, but a "
                f"{kind!r} task needs integer "
                f"{'token ids' if what == 'inputs' else 'class ids'}"
            )
        if floating and (not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16)):
            t = t.float()
        return t

    def _check_item(self, i: int, item: tuple) -> None:
        inputs, targets, _ = item
        spec, where = self.spec, f"{self.label}: item {i}"
        if tuple(inputs.shape) != spec.input_shape:
            raise UserCodeError(
                f"{where} has inputs of shape {tuple(inputs.shape)}, but the "
                f"task says input_shape = {spec.input_shape}"
            )
        if spec.kind == "classification":
            if targets.dim() != 0 or not 0 <= int(targets) < spec.num_classes:
                raise UserCodeError(
                    f"{where} has target {targets.tolist()!r}; a classification "
                    f"target is one class id in 0..{spec.num_classes - 1}"
                )
        elif spec.kind == "lm":
            if tuple(targets.shape) != spec.input_shape:
                raise UserCodeError(
                    f"{where} has targets of shape {tuple(targets.shape)}; for "
                    f"text they are the next tokens, shape {spec.input_shape}"
                )
            bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= spec.num_classes))
            if bool(bad.any()) or bool(((inputs < 0) | (inputs >= spec.num_classes)).any()):
                raise UserCodeError(
                    f"{where} has token ids outside 0..{spec.num_classes - 1} "
                    "(targets may also be -100, no loss)"
                )
        elif targets.numel() != spec.num_classes:
            raise UserCodeError(
                f"{where} has {targets.numel()} target value(s); the task says "
                f"num_classes = {spec.num_classes} outputs"
            )

    def _stack(self, tensors: list[torch.Tensor], ids: list[int], what: str) -> torch.Tensor:
        try:
            return torch.stack(tensors)
        except RuntimeError as e:
            shapes = [tuple(t.shape) for t in tensors]
            j = next((k for k, s in enumerate(shapes) if s != shapes[0]), None)
            if j is None:
                raise UserCodeError(
                    f"{self.label}: items {ids[:8]}'s {what} cannot be stacked: {e}"
                ) from None
            raise UserCodeError(
                f"{self.label}: item {ids[j]}'s {what} have shape "
                f"{shapes[j]}, item {ids[0]}'s {shapes[0]}; every item "
                "needs the same shape"
            ) from None


def load_user_dataset(
    path: str, *, split: str, kwargs: dict[str, Any], fn: Callable | None = None
) -> MapSource:
    """Call the user's data function for one split and wrap what it returns.

    Args:
        path: `data.source`, the import path (with `fn`, only its label).
        split: "train" or "eval".
        kwargs: `data.kwargs`.
        fn: the function itself (Python API), instead of importing `path`.
    """
    fn = fn if fn is not None else load_object(path, key="data.source")
    label = f"data.source = {path!r} (split {split!r})"
    result = call(fn, split, key="data.source", path=path, **kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UserCodeError(
            f"{label} returned a {type(result).__name__}; a data function returns (dataset, task)"
        )
    dataset, task = result
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise UserCodeError(
            f"{label} returned a {type(dataset).__name__} as its dataset, which "
            "has no __len__ and __getitem__ (a map-style dataset has both)"
        )
    spec = _task(task, label=label)
    if spec.kind == "lm":
        spec = replace(spec, ragged=True)  # counts may differ between ranks: all-reduce them
    return MapSource(dataset, spec, label=label)


def _task(task: Any, *, label: str) -> TaskSpec:
    if isinstance(task, TaskSpec):
        return task
    if not isinstance(task, dict):
        raise UserCodeError(
            f"{label} returned a {type(task).__name__} as its task; give a "
            "scaletrain.TaskSpec or a dict with kind, input_shape, num_classes"
        )
    try:
        return TaskSpec(
            kind=task["kind"],
            input_shape=tuple(task["input_shape"]),
            num_classes=int(task["num_classes"]),
        )
    except KeyError as e:
        raise UserCodeError(
            f"{label}: its task dict lacks {e.args[0]!r} (it needs kind "
            f"({', '.join(TASK_KINDS)}), input_shape, num_classes)"
        ) from None
    except (TypeError, ValueError) as e:
        raise UserCodeError(f"{label}: its task {task!r} is invalid: {e}") from None
