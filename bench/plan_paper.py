"""The planner against published runs, on paper: the same model, layout, batch and GPU as a
published training run, planned with the built-in GPU profile, next to the published
throughput and memory, with the ratio.

Each row builds the published model on the meta device (an HF LlamaConfig of the released
shapes), in the published layout (`parallel.*`), and asks `planner.plan_layouts` for that
layout alone in a fake process group of the published world size. Nothing runs on a GPU.

Sources (torchtitan's docs/performance.md, read 2026-12):
- Llama 3.1 8B, 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit), FSDP, local batch 2,
  sequence 8192, selective AC, no torch.compile: 5,762 tokens/s per GPU, 82.4 GiB (Table 1).
  torchtitan's Llama 3 8B recipe selects per op (`selective_ac_option = "op"`: attention's
  and every other matmul's outputs kept), which is scaletrain's
  `activation_checkpointing = "op"`. Its footnote 2: these HBM2e H100s at the lower power
  limit have a peak "between SXM and NVL", exact value unknown. The row is planned at the
  midpoint of the two datasheets' dense bf16 peaks (H100 SXM 989 TFLOP/s, H100 NVL 835.5:
  1,671 with sparsity), the MAMF scaled with it, and printed at both ends too.
- Llama 3 8B, 64 A100 80 GB, FSDP, local batch 1, sequence 8192, selective (op) AC:
  2,973 tokens/s per GPU, MFU 58.2%.
- Llama 3 70B, 64 A100 80 GB, FSDP, local batch 1, sequence 8192, full AC: 331 tokens/s
  per GPU, MFU 51.7%.
- Megatron-LM's GPT-3 175B on 1024 A100 80 GB (Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", section 5.1: batch 1536,
  140 TFLOP/s per GPU, counted with its 96 B s l h^2 (1 + s/6h + V/16lh), which includes
  the recomputed forward), in Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
  layout: tensor parallel 8, pipeline 16 (1F1B), so data parallel 8 (planned as ZeRO-2
  over 8, as scaletrain's DDP does not compose with tp and pp); micro-batch 1,
  sequence 2048, fp16, full recompute, vocabulary padded to 51,200. The published figure is
  FLOP/s; the row converts it to tokens/s per GPU with that formula. The model is
  scaletrain's built-in GPT (GPT-3's architecture: learned positions, pre-LayerNorm, a 4h
  GELU MLP) at GPT-3's shapes, through `gpt3_175b` below as the config's model factory (a
  Hugging Face model has no pipeline stages in scaletrain yet). No memory was published.

    .venv/bin/python bench/plan_paper.py
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)


def narayanan_flops_per_token(*, l: int, h: int, s: int, V: int) -> float:  # noqa: E741
    """Narayanan et al. 2021's FLOPs per token of a GPT step with full recompute."""
    return 96 * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def gpt3_175b(task, **kwargs):
    """The config's model factory for GPT-3 175B: the built-in GPT at its shapes."""
    from scaletrain.models.gpt import GPT, GPTShape

    shape = GPTShape(n_layer=96, n_head=96, n_embd=12288)
    return GPT(vocab_size=51200, block_size=2048, shape=shape)


LLAMA3_70B = dict(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
ROWS = [
    {
        "name": "torchtitan Llama 3.1 8B, 8 H100, FSDP, bs 2, selective (op) AC",
        "model": LLAMA3_8B,
        "hardware": "h100-96gb-500w",
        "world": 8,
        "local_batch": 2,
        "seq": 8192,
        "ac": "op",
        "tokens_per_s": 5762,
        "memory_gib": 82.4,
    },
    {
        "name": "torchtitan Llama 3 8B, 64 A100, FSDP, bs 1, selective (op) AC",
        "model": LLAMA3_8B,
        "hardware": "a100",
        "world": 64,
        "local_batch": 1,
        "seq": 8192,
        "ac": "op",
        "tokens_per_s": 2973,
        "memory_gib": None,
    },
    {
        "name": "torchtitan Llama 3 70B, 64 A100, FSDP, bs 1, full AC",
        "model": LLAMA3_70B,
        "hardware": "a100",
        "world": 64,
        "local_batch": 1,
        "seq": 8192,
        "ac": "full",
        "tokens_per_s": 331,
        "memory_gib": None,
    },
    {
        "name": "Megatron-LM GPT-3 175B, 1024 A100, tp 8 x pp 16 x dp 8, full AC",
        "model": "plan_paper:gpt3_175b",
        "hardware": "a100",
        "world": 1024,
        # a step's 192 micro-batches of 1 per data-parallel rank: in scaletrain, one
        # micro-batch of 192 that the pipeline splits into 192 chunks
        "local_batch": 192,
        "global_batch": 1536,
        "seq": 2048,
        "ac": "full",
        # Megatron's data parallelism all-reduces; scaletrain's DDP does not compose with
        # tp or pp, so ZeRO-2 (one gather of the parameters per step, the gradients
        # reduce-scattered: the same bytes as an all-reduce)
        "parallel": {
            "tp": 8,
            "pp": 16,
            "dp_shard": 8,
            "reshard_after_forward": False,
            "pp_schedule": "1f1b",
            "pp_microbatches": 192,
        },
        "precision": "fp16-mixed",
        "tokens_per_s": 140e12 / narayanan_flops_per_token(l=96, h=12288, s=2048, V=51200),
        "memory_gib": None,
    },
]


# the dense bf16 peaks torchtitan's H100s lie between (its docs/performance.md, footnote 2)
H100_SXM_BF16, H100_NVL_BF16 = 989e12, 835.5e12


def profile_of(name: str, *, bf16: float | None = None):
    """The built-in profile `name`, or torchtitan's Grand Teton H100 (96 GB HBM2e at
    2.4 TB/s, 500 W) at the dense bf16 peak `bf16` (default: the SXM-NVL midpoint), the
    matmuls at the same share of it as the SXM's MAMF."""
    from scaletrain.runtime.hardware import BUILTIN

    if name != "h100-96gb-500w":
        return BUILTIN[name]
    h100 = BUILTIN["h100"]
    bf16 = bf16 or (H100_SXM_BF16 + H100_NVL_BF16) / 2
    flops = {k: v * bf16 / H100_SXM_BF16 for k, v in h100.flops.items()}
    return dataclasses.replace(
        h100,
        name=name,
        flops=flops,
        memory_bytes=96 * 10**9,
        memory_bw=2.4e12,
        byte_s=6 / 2.4e12,
    )


def config_text(row: dict) -> str:
    if isinstance(row["model"], str):  # a model factory
        model = f'name = "{row["model"]}"'
    else:  # an HF LlamaConfig's arguments
        kwargs = ", ".join(f"{k} = {v}" for k, v in row["model"].items())
        model = f'name = "hf"\nhf_config = "LlamaConfig"\nkwargs = {{ {kwargs} }}'
    batch = row.get("global_batch", row["local_batch"] * row["world"])
    parallel = row.get("parallel", {"dp_shard": row["world"]})
    layout = "\n".join(  # JSON's scalars are TOML's
        f"{k} = {json.dumps(v)}"
        for k, v in {**parallel, "activation_checkpointing": row["ac"]}.items()
    )
    return f"""
[model]
{model}
[data]
source = "wikitext"
seq_len = {row["seq"]}
[train]
global_batch = {batch}
micro_batch = {row["local_batch"]}
[parallel]
{layout}
[precision]
mode = "{row.get("precision", "bf16-mixed")}"
"""


def main() -> None:
    from scaletrain.config import load_config
    from scaletrain.planner import predict_configured

    with tempfile.TemporaryDirectory() as tmp:
        for row in ROWS:
            path = Path(tmp) / "c.toml"
            path.write_text(config_text(row))
            config = load_config(path)
            profile = profile_of(row["hardware"])
            pred = predict_configured(config, world_size=row["world"], profile=profile)
            batch = row.get("global_batch", row["local_batch"] * row["world"])
            tokens = batch * row["seq"] / row["world"]
            tps = tokens / pred.step_time_s
            peak = pred.memory_bytes["peak"] / 2**30
            line = (
                f"{row['name']}: tokens/s per GPU predicted {tps:,.0f}, published "
                f"{row['tokens_per_s']:,.0f} (ratio {tps / row['tokens_per_s']:.2f}"
            )
            if row["hardware"] == "h100-96gb-500w":  # the peak's range, each end
                ends = [
                    tokens
                    / predict_configured(
                        config, world_size=row["world"], profile=profile_of(row["hardware"], bf16=f)
                    ).step_time_s
                    / row["tokens_per_s"]
                    for f in (H100_NVL_BF16, H100_SXM_BF16)
                ]
                line += f"; {ends[0]:.2f} at the NVL's peak, {ends[1]:.2f} at the SXM's"
            line += f"); predicted MFU {pred.mfu:.1%}; peak predicted {peak:.1f} GiB"
            if row["memory_gib"]:
                line += (
                    f", published {row['memory_gib']} GiB (ratio {peak / row['memory_gib']:.2f})"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
