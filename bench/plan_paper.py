"""The planner against published runs, on paper: the same model, layout, batch and GPU as a
published training run, planned with the built-in GPU profile, next to the published
throughput and memory, with the ratio.

Each row builds the published model on the meta device (an HF LlamaConfig of the released
shapes), in the published layout (`parallel.*`), and asks `planner.plan_layouts` for that
layout alone in a fake process group of the published world size. Nothing runs on a GPU.

Sources (torchtitan's docs/performance.md, read 2026-12):
- Llama 3.1 8B, 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit), FSDP, local batch 2,
  sequence 8192, selective AC, no torch.compile: 5,762 tokens/s per GPU, 82.4 GiB (Table 1).
  torchtitan's Llama 3 8B recipe selects per op (`selective_ac_option = "op"`: matmul and
  attention outputs kept), planned here as `activation_checkpointing = "op"`.
- Llama 3 8B, 64 A100 80 GB, FSDP, local batch 1, sequence 8192, selective (op) AC:
  2,973 tokens/s per GPU, MFU 58.2%.
- Llama 3 70B, 64 A100 80 GB, FSDP, local batch 1, sequence 8192, full AC: 331 tokens/s
  per GPU, MFU 51.7%.

    .venv/bin/python bench/plan_paper.py
"""

from __future__ import annotations

import dataclasses
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
]


def profile_of(name: str):
    from scaletrain.hardware import BUILTIN

    if name == "h100-96gb-500w":  # torchtitan's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s
        h100 = BUILTIN["h100"]
        return dataclasses.replace(
            h100, name=name, memory_bytes=96 * 10**9, memory_bw=2.4e12, byte_s=6 / 2.4e12
        )
    return BUILTIN[name]


def config_text(row: dict) -> str:
    kwargs = ", ".join(f"{k} = {v}" for k, v in row["model"].items())
    batch = row["local_batch"] * row["world"]
    return f"""
[model]
name = "hf"
hf_config = "LlamaConfig"
kwargs = {{ {kwargs} }}
[data]
source = "wikitext"
seq_len = {row["seq"]}
[train]
global_batch = {batch}
micro_batch = {row["local_batch"]}
[parallel]
dp_shard = {row["world"]}
activation_checkpointing = "{row["ac"]}"
[precision]
mode = "bf16-mixed"
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
            tps = row["local_batch"] * row["seq"] / pred.step_time_s
            peak = pred.memory_bytes["peak"] / 2**30
            line = (
                f"{row['name']}: tokens/s per GPU predicted {tps:,.0f}, published "
                f"{row['tokens_per_s']:,} (ratio {tps / row['tokens_per_s']:.2f}); "
                f"predicted MFU {pred.mfu:.1%}; peak predicted {peak:.1f} GiB"
            )
            if row["memory_gib"]:
                line += (
                    f", published {row['memory_gib']} GiB (ratio {peak / row['memory_gib']:.2f})"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()
