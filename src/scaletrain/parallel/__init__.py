"""Parallelism techniques, each a function applied to a model: apply_ddp, and later apply_fsdp, apply_tp, build_pipeline."""
