"""Pre-launch checks that need the model built: does it take the layout the config asks for?

`launch/resolve.resolve` checks the config against the world without building anything. What only the
model can answer (a TP plan whose heads and features divide by tp, enough blocks for the
pipeline's stages, blocks to checkpoint or to split into Streaming DiLoCo's fragments, a
parameter tensor for every server) is asked here, on a model built on the meta device in
the launcher's process, before any worker starts.
This module sits above training and ps, whose pieces it borrows: neither imports it.
"""

from __future__ import annotations

import torch

from scaletrain.config import Config
from scaletrain.errors import ConfigError, UserError
from scaletrain.launch.resolve import Derived
from scaletrain.models.protocol import block_modules, model_spec
from scaletrain.parallel.compose import check_model_fits, techniques_needing_the_model
from scaletrain.parallel.diloco import check_fragments
from scaletrain.ps.partition import PartitionError, model_partition
from scaletrain.training.assemble import NO_CODE, UserCode, build_data, build_net


def check_layout_fits(config: Config, derived: Derived, code: UserCode = NO_CODE) -> None:
    """The launcher's check that the model can take the layout (a TP plan whose heads and
    features divide by tp, enough blocks for the pipeline's stages, blocks to checkpoint),
    on a model built in this process: refused before any worker starts.

    Raises:
        ConfigError: naming the model, the key and what is allowed.
    """
    layout = derived.layout
    streaming = config.parallel.strategy == "diloco" and config.diloco.fragments > 1
    if (
        derived.ps is None
        and not streaming
        and not techniques_needing_the_model(layout, config.parallel)
    ):
        return
    torch.manual_seed(config.train.seed)
    train_ds = build_data(config, split="train", code=code)
    with torch.device("meta"):  # the shapes are enough: no memory, no init time
        model = build_net(config, train_ds, code=code, meta=True)
    if derived.ps is not None:  # every server must hold at least one parameter tensor
        try:
            model_partition(model, servers=derived.ps.servers)
        except PartitionError as e:
            raise ConfigError(f"model.name = {config.model.name!r}: {e}") from None
        return
    spec = model_spec(model)
    if streaming:  # Streaming DiLoCo's fragments split the blocks evenly
        blocks = len(block_modules(model, spec))
        check_fragments(
            blocks, config.diloco.fragments, model_label=f"model.name = {config.model.name!r}"
        )
    try:
        check_model_fits(
            model,
            spec,
            layout=layout,
            parallel=config.parallel,
            pipeline=derived.pipeline,
            model_label=f"model.name = {config.model.name!r}",
        )
    except UserError as e:  # ModelSpecError, TensorParallelError, PipelineConfigError
        raise ConfigError(str(e)) from None
