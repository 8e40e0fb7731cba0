"""The typed run configuration: defaults < TOML file < `section.key=value` overrides.

The schema and nothing else: one pydantic section per concern (model, data, optim, train,
parallel, ps, distill, precision, checkpoint, log, diloco), loading, overrides and the field
descriptions `scaletrain explain` prints. Validation here is per field: an unknown key (with
a did-you-mean), a wrong type or a value out of range becomes one `ConfigError` whose message
names the key, the value given and what is allowed. The CLI prints it and exits with status
2; no traceback.

Design notes:
- Sections are frozen pydantic models with `extra="forbid"`, so a typo is an error.
- Checks between fields, and those that need the world size, sit beside what they protect
  (parallel/layout.py, parallel/checks.py, distill/checks.py), called once by
  `launch/resolve.resolve`, which turns a `Config` plus a world size into `Derived` values. This
  module imports none of them: every room may read the schema, the schema reads no room.
- Overrides are parsed as TOML values (`train.steps=200`, `optim.betas=[0.9,0.95]`,
  `model.name=gpt`); anything that is not a TOML literal is taken as a string.
"""

from __future__ import annotations

import difflib
import functools
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from scaletrain.errors import ConfigError  # defined in a leaf; scaletrain.config.ConfigError too
from scaletrain.user_code import is_import_path

TEXT_SOURCES = ("wikitext", "wikitext-paragraphs", "synthetic-text")
BUILTIN_MODELS = ("mlp", "cnn", "gpt")
MODEL_NAMES = (*BUILTIN_MODELS, "hf")
DATA_SOURCES = (
    "digits",
    "mnist",
    "wikitext",
    "wikitext-paragraphs",
    "synthetic-images",
    "synthetic-text",
    "sentences",
    "shards",
)
LOSSES = ("auto", "cross-entropy", "mse")
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


def _name_or_import_path(value: str, allowed: tuple[str, ...]) -> str:
    """A field that takes a built-in name or the user's own `package.module:function`."""
    if value in allowed or is_import_path(value):
        return value
    close = difflib.get_close_matches(value, allowed, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"{hint}allowed: {', '.join(map(repr, allowed))}, or an import path "
        "'package.module:function' to your own"
    )


class _Section(BaseModel):
    # strict: no lax coercion (true is not 1 step, "3" is not 3); floats still accept ints.
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True
    )


class ModelConfig(_Section):
    name: str = "cnn"
    """mlp or cnn (images, tables), gpt (byte-level decoder, text), hf (a Hugging Face causal LM), or 'package.module:function', your factory called as function(task, **model.kwargs)."""
    size: Literal["tiny", "small", "base"] = "small"
    """Named size of a built-in architecture (mlp, cnn, gpt)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability of a built-in model (0 keeps runs bit-reproducible across layouts)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for your factory, or for the Hugging Face config (model.hf_config)."""
    path: str = ""
    """model.name = 'hf': a local model directory (config.json + safetensors weights) to fine-tune."""
    hf_config: str = ""
    """model.name = 'hf': a local config.json, or a transformers config class (e.g. LlamaConfig) built with model.kwargs, to train from scratch."""
    meta_init: bool = True
    """Build the model on the meta device and materialise each rank's shards only (README, 'Models bigger than one device'); false: every rank builds the whole model first, then the layout splits it (the same values; the whole model's memory on every rank)."""

    @field_validator("name")
    @classmethod
    def _known_or_import_path(cls, value: str) -> str:
        return _name_or_import_path(value, MODEL_NAMES)


class DataConfig(_Section):
    source: str = "mnist"
    """Built-in dataset: images (digits, mnist, synthetic-images) or text (packed wikitext,
    padded wikitext-paragraphs, synthetic-text), "sentences" (tokenized sentences for an
    encoder, data.kwargs: tokenizer, corpora, words, augment); "shards": Parquet shards at
    data.path; or 'package.module:function', yours, called as function(split, **data.kwargs)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for your data function (data.source = 'package.module:function') or for "sentences"."""
    path: str = ""
    """For data.source = "shards": the directory `scaletrain shard` (or Spark) wrote."""
    shuffle_window: int = Field(0, ge=0)
    """Rows shuffled together after the shards are shuffled; 0 = the whole dataset."""
    seq_len: int = Field(128, ge=8, le=131072)
    """Tokens per example for text sources (bytes of context)."""
    synthetic_examples: int = Field(4096, ge=1)
    """Examples generated by the synthetic sources."""

    @field_validator("source")
    @classmethod
    def _known_or_import_path(cls, value: str) -> str:
        return _name_or_import_path(value, DATA_SOURCES)


# torch.optim's optimizers that the train step cannot drive, and why (training/optim.py).
REFUSED_OPTIMIZERS = {
    "lbfgs": "its step needs a closure that evaluates the loss again several times, and the "
    "train step calls step() once after its backward",
    "sparseadam": "it takes only sparse gradients (nn.Embedding(sparse=True)), and the models "
    "and parallel layouts here produce dense ones",
}


@functools.cache
def optimizer_names() -> tuple[str, ...]:
    """Every optimizer class torch.optim ships, by its lowercase name (adamw, muon, ...),
    read from the installed torch; REFUSED_OPTIMIZERS among them."""
    import torch.optim

    return tuple(
        sorted(
            name.lower()
            for name, obj in vars(torch.optim).items()
            if isinstance(obj, type)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
        )
    )


class OptimConfig(_Section):
    name: str = "adamw"
    """Optimizer: any torch.optim ships, by its lowercase name (adamw, adam, sgd, nadam, radam, adamax, adagrad, adadelta, rmsprop, asgd, rprop, adafactor, muon: Muon on the hidden layers' matrices, AdamW on the rest), or 'package.module:Class', your torch.optim.Optimizer subclass."""
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    """Peak learning rate, reached after warmup."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Weight decay, for every optimizer that takes one: decoupled (adamw, muon) or an L2 penalty (sgd, adam and most others)."""
    betas: Annotated[tuple[Beta, Beta], Field(strict=False)] = (0.9, 0.999)
    """Moment decay rates, for every optimizer that takes betas (the Adam family)."""
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum, for every optimizer that takes one (sgd, rmsprop, muon)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 to lr over this many optimizer steps."""
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "cosine"
    """LR after warmup: constant; cosine or linear decay to min_lr_ratio * lr at the last step; wsd (warmup-stable-decay): constant, then a linear decay to min_lr_ratio * lr over the last decay_fraction of the steps."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final LR as a fraction of the peak, for the cosine, linear and wsd schedules."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    impl: Literal["auto", "fused", "foreach"] = "auto"
    """Optimizer kernels: fused (one kernel per step), foreach (multi-tensor), auto = fused where the device supports it."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the optimizer's constructor beyond lr, weight_decay, betas and momentum (which are passed wherever the constructor takes them), e.g. {eps = 1e-6} or, for muon, {ns_steps = 5}."""
    decay_fraction: float = Field(0.2, gt=0.0, le=1.0)
    """schedule = wsd: the fraction of train.steps at the end over which the LR decays."""

    @field_validator("name")
    @classmethod
    def _torch_or_import_path(cls, value: str) -> str:
        if value in REFUSED_OPTIMIZERS:
            raise ValueError(f"torch.optim's {value} cannot be used: {REFUSED_OPTIMIZERS[value]}")
        return _name_or_import_path(
            value, tuple(n for n in optimizer_names() if n not in REFUSED_OPTIMIZERS)
        )


class TrainConfig(_Section):
    steps: int = Field(1000, ge=0)
    """Optimizer steps to run; 0 evaluates and saves the initial weights (an init-only run)."""
    global_batch: int = Field(64, ge=1)
    """Examples per optimizer step, summed over all ranks and micro-batches."""
    micro_batch: int = Field(32, ge=1)
    """Examples per forward/backward on one rank."""
    seed: int = Field(0, ge=0)
    """Seed for model init, data order and every RNG."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the held-out split every N steps (0: only at the end)."""
    eval_examples: int = Field(10000, ge=1)
    """At most this many held-out examples per evaluation."""
    eval_gather: Literal["auto", "keep", "per-batch"] = "auto"
    """Under dp_shard, an evaluation's gathered parameters: keep = gathered once and kept for all its micro-batches, per-batch = gathered for each forward (no more memory than a step), auto = keep when the unsharded model takes at most a quarter of this rank's share of the machine's available memory."""
    max_bad_steps: int = Field(5, ge=1)
    """Stop after this many consecutive steps with a non-finite loss or gradient."""
    threads: int = Field(0, ge=0)
    """Torch threads per process; 0 = available cores / processes on this node."""
    stop_after: int = Field(0, ge=0)
    """Planned stop: checkpoint and exit after this step (0: run to train.steps)."""
    compile: bool = False
    """Wrap the model in torch.compile (inductor) before DDP; the first steps pay the compile time."""
    allocator: Literal["auto", "system", "retain", "release"] = "auto"
    """CPU heap: retain keeps freed activation memory mapped (no per-step mmap/munmap), release hands every freed block of 1 MiB or more back (for large models), system = glibc's defaults, auto = retain on CPU for a model under 256 MiB of parameters, release from there on."""
    loss: str = "auto"
    """cross-entropy, mse, auto (mse for regression data, else cross-entropy), or 'package.module:function' returning (summed loss, count) for (model output, batch)."""

    @field_validator("loss")
    @classmethod
    def _known_or_import_path(cls, value: str) -> str:
        return _name_or_import_path(value, LOSSES)


class ParallelConfig(_Section):
    strategy: Literal["collective", "ps", "diloco"] = "collective"
    """collective: every rank steps together (DDP, FSDP, TP, PP over torch.distributed); ps: asynchronous parameter servers (the [ps] section; ranks 0..ps.servers-1 serve, the rest are workers); diloco: islands (parallel.dp_replicate) train apart and average their progress every diloco.sync_every steps (the [diloco] section)."""
    dp_replicate: int = Field(-1, ge=-1)
    """Data-parallel replicas holding whole parameters (DDP; with dp_shard > 1 the replicate dimension of HSDP); -1 = what the other degrees leave over."""
    dp: int = Field(-1, ge=-1)
    """The older name of parallel.dp_replicate (give one of the two)."""
    dp_shard: int = Field(1, ge=-1)
    """Data-parallel ranks sharding parameters, gradients and optimizer state (FSDP2, ZeRO); -1 = what the other degrees leave over."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: each block's matmuls split over this many ranks (must divide the heads)."""
    sequence_parallel: bool = True
    """tp > 1: also split the residual stream by positions between the matmuls (norms, dropout, residual adds on T/tp each), where the model declares how (the built-in GPT); false = plain Megatron TP."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree: the model's blocks split into this many stages (x pp_stages_per_rank)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b or zero-bubble (torch.distributed.pipelining)."""
    pp_microbatches: int = Field(0, ge=0)
    """Chunks each train.micro_batch is split into for the pipeline; 0 = pp x pp_stages_per_rank."""
    pp_stages_per_rank: int = Field(0, ge=0)
    """Pipeline stages on each rank: 1 for gpipe/1f1b, >= 2 for interleaved-1f1b, any for zero-bubble (1 = ZB-H1); 0 = 1 for gpipe/1f1b, else 2."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3); false keeps them until backward (ZeRO-2, more memory, one all-gather fewer)."""
    activation_checkpointing: Literal["none", "full", "selective", "op"] = "none"
    """Recompute activations in backward: full (every block), selective (every other block), op (every block, keeping its matmuls' and attention's outputs: only element-wise ops run again), none."""
    fsdp_offload: bool = False
    """FSDP2's CPU offload: parameters, gradients and optimizer step in CPU memory. Tested on CPU runs (gloo: equal to one process); refused on GPUs until scaletrain creates the CPU process group the offloaded gradients need beside NCCL."""

    @property
    def replicate(self) -> int:
        """dp_replicate, or its older name dp when only that is given (-1: unset)."""
        return self.dp_replicate if self.dp_replicate != -1 else self.dp

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto picks nccl when CUDA is available, else gloo."""
    bucket_cap_mb: float = Field(25.0, gt=0.0, le=1024.0)
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias DDP's buckets (saves one gradient copy of memory)."""
    timeout_s: float = Field(300.0, gt=0.0)
    """A collective that has not completed after this many seconds ends the run."""
    comm_hook: Literal["none", "fp16", "bf16", "powersgd", "batched-powersgd"] = "none"
    """Gradient compression for DDP's all-reduce: none, fp16, bf16, powersgd, batched-powersgd."""
    powersgd_rank: int = Field(1, ge=1, le=64)
    """PowerSGD: rank of the low-rank gradient approximation."""
    powersgd_start_iter: int = Field(10, ge=2)
    """PowerSGD: plain all-reduce for this many steps first (warm-up), then compress."""


class PSConfig(_Section):
    servers: int = Field(1, ge=1)
    """parallel.strategy = 'ps': server ranks (0 .. servers-1); the parameters are split across them, balanced by bytes."""
    mode: Literal["async", "ssp", "sync"] = "async"
    """async: apply each gradient as it arrives (Downpour); ssp: also hold a worker while it is more than ps.staleness steps ahead of the slowest live worker; sync: apply once every live worker's gradient for the step is in (their mean)."""
    staleness: int = Field(2, ge=0)
    """ps.mode = 'ssp': how many steps a worker may run ahead of the slowest live worker (0 = bulk-synchronous)."""
    staleness_lr: Literal["none", "inverse"] = "none"
    """inverse: scale each update's learning rate by 1 / (1 + its delay, the server updates applied since the worker read its parameters); none: the schedule's rate."""
    worker_timeout_s: float = Field(10.0, gt=0.0)
    """A worker not heard from (gradients or heartbeats) for this long is declared dead; the run goes on without it and refuses its late messages."""
    interface: str = "lo"
    """Network interface that servers and workers listen on (TensorPipe's TP_SOCKET_IFNAME): lo = loopback, one machine; on several machines the one their hosts reach each other on (e.g. eth0)."""


class DiLoCoConfig(_Section):
    sync_every: int = Field(50, ge=1)
    """parallel.strategy = 'diloco': inner steps between two syncs of the islands (H; the paper's runs use 500 over ~88k steps, 50 keeps tens of outer steps in runs of a few thousand)."""
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    """Learning rate of the outer SGD step applied to the islands' averaged pseudo-gradient."""
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum of the outer SGD step (0: plain SGD)."""
    nesterov: bool = True
    """Nesterov momentum for the outer step (needs diloco.outer_momentum > 0)."""
    fragments: int = Field(1, ge=1)
    """Streaming DiLoCo: the model's blocks in this many fragments, each synced every sync_every steps, staggered by sync_every / fragments (1: the whole model at once)."""
    overlap_steps: int = Field(0, ge=0)
    """Streaming DiLoCo: inner steps a fragment's exchange overlaps before its outer update is applied (tau; 0: applied at once)."""
    overlap_alpha: float = Field(0.5, ge=0.0, le=1.0)
    """overlap_steps > 0: weight of the local parameters when the outer update is merged in (0: the outer result alone)."""
    quantize: Literal["none", "bf16", "fp16", "int8", "int4"] = "none"
    """Format of the exchanged pseudo-gradients: none (all-reduced in the master dtype), bf16 or fp16 (cast), int8 or int4 (per-block absmax scales, two int4 codes a byte)."""
    quantize_block: int = Field(128, ge=2, le=1 << 20)
    """int8 / int4: elements per fp32 scale (even)."""


class DistillConfig(_Section):
    teacher: str = ""
    """Knowledge distillation's frozen teacher ("" = no distillation): a scaletrain run directory, a local Hugging Face / sentence-transformers directory, or 'all-MiniLM-L6-v2' (the packaged one)."""
    teacher_sha256: str = ""
    """The SHA-256 the teacher's safetensors weights must have ("" = only the packaged teacher's own is checked)."""
    teacher_precision: Literal["same", "fp32", "bf16", "fp64"] = "same"
    """The teacher's inference dtype (weights and compute); same = the student's compute dtype."""
    temperature: float = Field(2.0, gt=0.0, le=100.0)
    """Softmax temperature T of the soft targets (the KL is scaled by T^2)."""
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    """Weight of the soft-target KL; 1 - alpha weighs the hard-label loss (train.loss). Logit tasks only."""
    hidden_weight: float = Field(0.0, ge=0.0)
    """Weight of the hidden-state MSE through learned projections (FitNets / TinyBERT); Hugging Face models."""
    attention_weight: float = Field(0.0, ge=0.0)
    """Weight of the attention-map MSE (TinyBERT); Hugging Face models with as many heads as the teacher."""
    cosine_weight: float = Field(0.0, ge=0.0)
    """Weight of the cosine loss 1 - cos(student, teacher) on pooled embeddings or logits (DistilBERT)."""
    cosine_on: Literal["pooled", "logits"] = "pooled"
    """What the cosine loss compares: mean-pooled last hidden states (encoders) or the logits."""
    relation_weight: float = Field(0.0, ge=0.0)
    """Weight of MiniLM's self-attention relation loss: KL of the last layer's attention distributions and value relations, per student attention head, over real tokens; Hugging Face encoders (query/key/value projections)."""
    contrastive_weight: float = Field(0.0, ge=0.0)
    """Weight of the in-batch contrastive loss (InfoNCE) on mean-pooled embeddings: the teacher's embedding of the same example is the positive, the micro-batch's others the negatives; encoders, train.micro_batch >= 2."""
    contrastive_temperature: float = Field(0.05, gt=0.0, le=100.0)
    """Temperature tau of the contrastive loss: cosine similarities are divided by it."""
    layer_map: list[int] = []
    """Teacher layer each student hidden state learns (0 = embeddings), one per student state; [] = uniform (TinyBERT)."""
    init_layers: list[int] = []
    """Teacher blocks (0-based) copied into the student's blocks, plus the other same-shaped weights; [] = the student's own init."""
    cache: str = ""
    """A teacher-output cache written by `scaletrain distill-cache`; the run then loads no teacher."""
    top_k: int = Field(0, ge=0)
    """distill-cache: teacher logits kept per example or token (0 = all)."""


class PrecisionConfig(_Section):
    mode: Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp64", "auto"] = "fp32"
    """fp32, bf16-mixed, fp16-mixed (loss scaling), bf16-true, fp64 (for verifying numerics, slow), or auto (the faster of fp32 and bf16-mixed on this model, measured where the CPU runs bf16 natively; fp32 where bf16 is emulated; bf16-mixed on a GPU of compute capability >= 8.0)."""
    init_scale: float = Field(2.0**16, gt=0.0)
    """fp16-mixed: initial dynamic loss scale."""
    growth_interval: int = Field(2000, ge=1)
    """fp16-mixed: clean steps before the loss scale doubles."""
    tf32: bool = False
    """CUDA: fp32 matmuls and convolutions on the TF32 tensor cores (Ampere or later; inputs rounded to a 10-bit mantissa, fp32 accumulation): much faster, less exact; false keeps them full fp32. The planner and MFU count fp32 at the part's TF32 rate where it is on."""


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)
    """Save a checkpoint every N steps (0: never); runs resume from the newest valid one."""
    keep: int = Field(2, ge=1)
    """Keep the last K complete checkpoints."""
    async_save: bool = False
    """Write checkpoints in the background, overlapping the following steps."""


class LogConfig(_Section):
    every: int = Field(10, ge=1)
    """Write a metrics record every N steps."""
    quiet: bool = False
    """No progress bar, only errors."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (the same as "tensorboard" in log.trackers)."""
    trackers: list[Literal["tensorboard", "mlflow", "wandb", "csv"]] = []
    """Experiment trackers fed on rank 0 with metrics.jsonl's records, the config and the report: tensorboard, mlflow (RUN_DIR/mlruns or MLFLOW_TRACKING_URI), wandb (WANDB_MODE; offline without an API key), csv (RUN_DIR/metrics.csv)."""
    profile_steps: list[int] = []
    """[a, b]: a torch.profiler trace of train steps a..b (counted from 1, as train.steps and train.stop_after count) on every rank, to RUN_DIR/profile/rank-N/ (Chrome/Perfetto JSON that TensorBoard's profiler reads; the memory timeline on CUDA); [] = no profiling."""
    oom_snapshot: bool = True
    """CUDA: record the allocator's history from the start and, when a rank runs out of GPU memory, write its snapshot to RUN_DIR/memory/rank-N-oom.pickle (for pytorch.org/memory_viz); nothing on CPU."""

    @field_validator("profile_steps")
    @classmethod
    def _first_to_last(cls, value: list[int]) -> list[int]:
        if value and (len(value) != 2 or not 1 <= value[0] <= value[1]):
            raise ValueError(
                "give [first, last] train steps with 1 <= first <= last (steps count from "
                "1, e.g. log.profile_steps=[10, 12]), or [] for no profiling"
            )
        return value


class Config(_Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name, used in the default run directory runs/<name>-<time>."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    ps: PSConfig = PSConfig()
    distill: DistillConfig = DistillConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    diloco: DiLoCoConfig = DiLoCoConfig()


# --------------------------------------------------------------------------- loading


def load_config(path: Path | None, overrides: list[str] = ()) -> Config:
    """Read defaults < TOML file < dotted overrides into a validated Config.

    Args:
        path: a TOML file, or None for the defaults alone.
        overrides: `section.key=value` strings, applied in order.

    Raises:
        ConfigError: with a message naming the key, the value and what is allowed.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(
                f"config file {str(path)!r} is a directory; give a TOML file "
                "(e.g. configs/default.toml)"
            )
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    return validate_config(apply_overrides(data, overrides))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `section.key=value` in the nested dict `data` (in place) and return it."""
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(data, key, value)
    return data


# Keys the schema once had, with the value they held unless set and where they went: an
# older run's config.toml (which writes every key) still loads and resumes; set to anything
# else, the key is refused with the reason.
_STRAGGLER_MOVED = "the benchmarks' straggler is a model factory now (bench/straggler.py)"
RETIRED_KEYS = {
    ("ps", "slow_worker"): (-1, _STRAGGLER_MOVED),
    ("ps", "slow_factor"): (1.0, _STRAGGLER_MOVED),
}


def validate_config(data: dict[str, Any]) -> Config:
    """Validate a nested dict against the schema; raise one ConfigError for the first problem."""
    data = _without_retired(data)
    _check_keys(data, Config, prefix="")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, data)) from None


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(
            f"override {item!r} is not of the form section.key=value (e.g. train.steps=200)"
        )
    key, raw = item.split("=", 1)
    key = key.strip()
    try:  # a TOML literal: numbers, booleans, arrays, quoted strings
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word, e.g. model.name=gpt
    return key, value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section"
            )
        node = child
    node[parts[-1]] = value


def _without_retired(data: dict[str, Any]) -> dict[str, Any]:
    """`data` less the retired keys that hold their old default (RETIRED_KEYS); the
    caller's dict is left as it was."""
    for (section, key), (default, moved) in RETIRED_KEYS.items():
        keys = data.get(section)
        if not isinstance(keys, dict) or key not in keys:
            continue
        if keys[key] != default:
            raise ConfigError(f"{section}.{key} = {keys[key]!r} is no longer a key: {moved}")
        data = {**data, section: {k: v for k, v in keys.items() if k != key}}
    return data


def _check_keys(data: dict[str, Any], schema: type[BaseModel], *, prefix: str) -> None:
    """Unknown keys get a did-you-mean before pydantic sees them."""
    fields = schema.model_fields
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            allowed = ", ".join(fields)
            section = prefix.rstrip(".") or "the top level"
            raise ConfigError(f"unknown key {where!r} in {section}{hint} (allowed: {allowed})")
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"{where} is a section ([{where}]), not a value; got {value!r}")
            _check_keys(value, annotation, prefix=f"{where}.")


def _describe(error: ValidationError, data: dict[str, Any]) -> str:
    first = error.errors()[0]
    path = list(first["loc"])
    while path and isinstance(path[-1], int):  # optim.betas.1 -> optim.betas
        path.pop()
    loc = ".".join(str(p) for p in path)
    given = _lookup(data, path) if len(path) < len(first["loc"]) else first.get("input")
    msg = first["msg"]
    if first["type"] in ("missing", "too_short", "too_long") and len(path) < len(first["loc"]):
        default = _default(path)
        if isinstance(default, tuple):  # a fixed-length field given too few or too many values
            msg = f"expected {len(default)} values, e.g. {loc}={list(default)}"
    elif first["type"] == "string_pattern_mismatch":
        msg = "use only letters, digits, '_', '.' and '-'"
    elif first["type"] == "value_error":  # our validators' messages, without pydantic's prefix
        msg = str(first["ctx"]["error"])
    ctx = first.get("ctx") or {}
    if "expected" in ctx:
        msg = f"allowed values are {ctx['expected']}"
    if isinstance(given, float) and given != given:  # NaN fails any bound; the bound is not why
        msg = f"NaN is not allowed; give a finite number ({msg[0].lower()}{msg[1:]})"
    more = f" (and {error.error_count() - 1} more problem(s))" if error.error_count() > 1 else ""
    return f"{loc} = {given!r} is invalid: {msg}{more}"


def _default(path: list) -> Any:
    """The schema's default at a dotted path (None if the path is not a field)."""
    node: Any = Config()
    for part in path:
        node = getattr(node, str(part), None)
    return node


def _lookup(data: dict[str, Any], path: list) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def config_to_toml(config: Config) -> str:
    """The resolved config as TOML, as stored in every run directory."""
    return tomli_w.dumps(config.model_dump(mode="json"))


def flatten_config(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as one level of dotted keys: {"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe_fields(config: Config) -> list[tuple[str, Any, str]]:
    """(dotted key, value, description) for every field, for `explain`."""
    rows = []
    for section_name, section_field in Config.model_fields.items():
        section = getattr(config, section_name)
        if not isinstance(section, BaseModel):
            rows.append((section_name, section, section_field.description or ""))
            continue
        for key, field in type(section).model_fields.items():
            rows.append((f"{section_name}.{key}", getattr(section, key), field.description or ""))
    return rows


def given_world(config: Config) -> int:
    """The product of the degrees the config gives (a -1 counts as 1: the smallest world);
    under parallel.strategy = 'ps', the servers plus the workers (parallel.dp)."""
    pc = config.parallel
    if pc.strategy == "ps":
        return config.ps.servers + max(pc.replicate, 1)
    return pc.pp * pc.tp * max(pc.replicate, 1) * max(pc.dp_shard, 1)
