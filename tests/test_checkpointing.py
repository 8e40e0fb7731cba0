"""Activation checkpointing recomputes instead of storing: the gradients are the same, the
activations saved for backward are fewer, and state-dict names do not change."""

from __future__ import annotations

import copy

import pytest
import torch

from scaletrain.models.gpt import GPT, GPTShape
from scaletrain.parallel.checkpointing import apply_activation_checkpointing


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(
        vocab_size=256, block_size=32, shape=GPTShape(n_layer=4, n_head=2, n_embd=64)
    ).double()


def _saved_bytes_and_grads(model: GPT, x: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward during the forward, and the gradients after it."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(
            model(x).flatten(0, 1), x.flatten(), reduction="sum"
        )
    loss.backward()
    return saved[0], {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("mode, wrapped", [("full", 4), ("selective", 2)])
def test_checkpointing_saves_less_and_changes_no_gradient(mode: str, wrapped: int) -> None:
    x = torch.randint(0, 256, (4, 32))
    plain, checkpointed = (
        _model(),
        apply_activation_checkpointing(_model(), blocks_path="blocks", mode=mode),
    )
    kinds = [type(b).__name__ for b in checkpointed.blocks.values()]
    assert kinds.count("CheckpointWrapper") == wrapped
    plain_bytes, plain_grads = _saved_bytes_and_grads(plain, x)
    ckpt_bytes, ckpt_grads = _saved_bytes_and_grads(checkpointed, x)
    print(f"{mode}: saved for backward {plain_bytes} -> {ckpt_bytes} bytes")
    assert ckpt_bytes < plain_bytes * (0.4 if mode == "full" else 0.75)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, g in plain_grads.items():
        assert torch.equal(g, ckpt_grads[name]), name


def test_checkpointing_keeps_state_dict_names() -> None:
    plain = _model()
    checkpointed = apply_activation_checkpointing(
        copy.deepcopy(plain), blocks_path="blocks", mode="full"
    )
    assert list(checkpointed.state_dict()) == list(plain.state_dict())


def test_none_changes_nothing() -> None:
    model = _model()
    assert apply_activation_checkpointing(model, blocks_path="blocks", mode="none") is model
    assert all(type(b).__name__ == "Block" for b in model.blocks.values())


def _backward_ops(model: GPT, x: torch.Tensor) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """The aten ops backward runs, by name (a matrix product's also by its output's width:
    "addmm:64"), and the gradients."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            ops[name] += 1
            if name in ("mm", "addmm", "bmm"):
                ops[f"{name}:{out.shape[-1]}"] += 1
            return out

    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten(), reduction="sum")
    with Count():
        loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }
    return ops, grads


def test_op_mode_recomputes_the_element_wise_ops_and_every_second_matmul() -> None:
    """ "op" (torchtitan's) keeps attention's output and every block's 1st, 3rd and 5th
    matrix product (the GPT's q, v and its MLP's 4C-wide fc) and runs the rest again in
    backward: the 2nd and 4th (k and the attention projection, both C wide: 2 a block; the
    MLP's projection, 6th and last, is never needed again, and torch's recomputation stops
    before it), where full checkpointing multiplies more again, and the blocks' norms;
    every gradient is bit-identical."""
    x = torch.randint(0, 256, (4, 32))
    plain, _ = _backward_ops(_model(), x)
    full, _ = _backward_ops(
        apply_activation_checkpointing(_model(), blocks_path="blocks", mode="full"), x
    )
    model = apply_activation_checkpointing(_model(), blocks_path="blocks", mode="op")
    assert [type(b).__name__ for b in model.blocks.values()] == ["CheckpointWrapper"] * 4
    op, grads = _backward_ops(model, x)
    matmuls = ("mm", "addmm", "bmm")
    assert sum(full[k] for k in matmuls) > sum(plain[k] for k in matmuls) + 2 * 4
    assert sum(op[k] for k in matmuls) - sum(plain[k] for k in matmuls) == 2 * 4
    again = {k: op[k] - plain[k] for k in op if ":" in k and op[k] != plain[k]}
    assert again == {"addmm:64": 2 * 4}  # each block's k and attention projection
    assert plain["native_layer_norm"] == 0 and op["native_layer_norm"] == 2 * 4  # ln_1, ln_2
    _, plain_grads = _saved_bytes_and_grads(_model(), x)
    assert grads.keys() == plain_grads.keys()
    for name, g in plain_grads.items():
        assert torch.equal(g, grads[name]), name
