"""The model protocol (models/protocol.py): what a model declares to FSDP, tensor and
pipeline parallelism, how a spec is decided, checked, and refused where it lacks a field."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models import build_model
from scaletrain.models.protocol import (
    ModelSpec,
    ModelSpecError,
    PipelineSplit,
    block_modules,
    find_repeated_blocks,
    model_spec,
    output_logits,
    require,
    tp_targets,
)

TEXT = TaskSpec("lm", (16,), 256)


def test_gpt_declares_blocks_tp_plan_and_pipeline_split() -> None:
    gpt = build_model("gpt", size="tiny", task=TEXT)
    spec = model_spec(gpt)
    assert spec.source == "declared" and spec.blocks == "blocks"
    assert len(block_modules(gpt, spec)) == 2
    targets = tp_targets(gpt, spec)
    assert targets["blocks.0.attn.q"] == "colwise" and targets["blocks.1.mlp.proj"] == "rowwise"
    assert len(targets) == 2 * 6  # q, k, v, proj, fc, proj in each of the 2 blocks
    assert spec.pipeline == PipelineSplit(
        first=("tok_emb", "pos_emb"), blocks="blocks", last=("ln_f", "lm_head")
    )
    for technique in ("fsdp", "activation-checkpointing", "tp", "pp"):
        require(spec, technique, model_label="model.name = 'gpt'")


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_user_module_gets_its_repeated_children_as_blocks_and_nothing_else() -> None:
    spec = model_spec(Stack())
    assert spec == ModelSpec(blocks="layers") and spec.source == "default"
    require(spec, "fsdp", model_label="model.name = 'pkg:build'")
    with pytest.raises(
        ModelSpecError,
        match=r"model.name = 'pkg:build' declares no "
        r"tensor-parallel plan, which tp needs",
    ):
        require(spec, "tp", model_label="model.name = 'pkg:build'")
    with pytest.raises(ModelSpecError) as e:
        require(spec, "pp", model_label="model.name = 'pkg:build'")
    assert "pipeline split" in str(e.value) and "scaletrain_spec" in str(e.value)


def test_a_module_that_repeats_nothing_has_no_blocks_and_fsdp_is_refused() -> None:
    mlp = build_model("mlp", size="tiny", task=TaskSpec("classification", (1, 8, 8), 10))
    assert find_repeated_blocks(mlp) is None
    with pytest.raises(ModelSpecError, match="repeated blocks"):
        require(model_spec(mlp), "fsdp", model_label="model.name = 'mlp'")


def test_a_declared_spec_wins_and_is_checked_against_the_modules() -> None:
    model = Stack()
    model.scaletrain_spec = ModelSpec(blocks="layers", tp_plan={"layers.*.0": "colwise"})
    assert tp_targets(model, model_spec(model)) == {f"layers.{i}.0": "colwise" for i in range(3)}
    bad = {
        "no such module": ModelSpec(blocks="layer"),
        "must name an nn.ModuleList": ModelSpec(blocks="stem"),
        "matches no module": ModelSpec(tp_plan={"layers.*.q": "colwise"}),
        "allowed styles": ModelSpec(tp_plan={"layers.*.0": "columnwise"}),
        "only nn.Linear": ModelSpec(tp_plan={"layers.*.1": "rowwise"}),
        "pipeline module 'norm'": ModelSpec(pipeline=PipelineSplit(("stem",), "layers", ("norm",))),
    }
    for message, spec in bad.items():
        model.scaletrain_spec = spec
        with pytest.raises(ModelSpecError, match=message):
            model_spec(model)
    model.scaletrain_spec = {"blocks": "layers"}
    with pytest.raises(ModelSpecError, match="not a scaletrain ModelSpec"):
        model_spec(model)


def test_output_logits_reads_tensors_model_outputs_and_tuples() -> None:
    t = torch.zeros(2, 3)

    class Out:
        logits = t

    assert output_logits(t) is t and output_logits(Out()) is t and output_logits((t, 1)) is t
    with pytest.raises(TypeError, match="returned a dict"):
        output_logits({"x": t})
