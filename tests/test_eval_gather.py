"""An evaluation of a sharded model gathers it once, not once per micro-batch, where memory
allows (train.eval_gather, training/evaluate.py): FSDP2's units stay gathered across the
evaluation's forwards and are resharded, with their setting back, when it ends.

Counted over a fake process group in the test process (the all-gathers FSDP2 issues; no
peers needed to count them): the GPT's 4 blocks and its root, 3 forwards. The root stays
gathered after a forward (FSDP2's default for the root: backward follows), so the
blocks are what a forward gathers."""

from __future__ import annotations

import pytest
import torch

from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.models.protocol import block_modules, model_spec
from scaletrain.training.evaluate import gathered_for_eval, keeps_gathered

FORWARDS = 3


def _sharded_gpt():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model("gpt", size="small", task=TaskSpec("lm", (8,), 256))
    mesh = init_device_mesh("cpu", (2,))
    for block in block_modules(model, model_spec(model)):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("keep", [True, False])
def test_an_evaluation_gathers_the_model_once_when_it_keeps_it(monkeypatch, keep: bool) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    gathers = []
    real = dist.all_gather_single
    monkeypatch.setattr(
        dist, "all_gather_single", lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = _sharded_gpt()
        blocks = len(block_modules(model, model_spec(model)))
        x = torch.zeros(2, 8, dtype=torch.int64)
        with torch.no_grad():
            model(x)  # training ran before (FSDP2's lazy init); the root stays gathered
            gathers.clear()
            with gathered_for_eval(model, keep=keep):
                for _ in range(FORWARDS):
                    model(x)
            during = len(gathers)
            model(x)  # after the evaluation: each block gathered per forward again
            model(x)
        after = len(gathers) - during
    finally:
        dist.destroy_process_group()
    assert during == (blocks if keep else FORWARDS * blocks)
    # keep: every unit resharded at the end (the root too, gathered again once)
    assert after == (1 + 2 * blocks if keep else 2 * blocks)


def test_auto_keeps_a_model_that_fits_a_quarter_of_the_ranks_share(monkeypatch) -> None:
    from scaletrain.training import evaluate

    monkeypatch.setattr(evaluate, "available_bytes", lambda: 16 * 2**30)
    assert keeps_gathered("auto", unsharded_bytes=2**30, local_ranks=4)  # 1 <= 16 / 4 / 4
    assert not keeps_gathered("auto", unsharded_bytes=2**30 + 1, local_ranks=4)
    assert keeps_gathered("keep", unsharded_bytes=2**40, local_ranks=4)
    assert not keeps_gathered("per-batch", unsharded_bytes=1, local_ranks=4)
    monkeypatch.setattr(evaluate, "available_bytes", lambda: None)
    assert not keeps_gathered("auto", unsharded_bytes=1, local_ranks=1)
