"""Distillation under FSDP2 (parallel.dp_shard = 2): the student and the teacher are sharded.

The 4-layer BERT teacher is fully_shard-ed block by block over the same dp_shard mesh as the
student (distill/teacher.place_teacher): each rank keeps half of its weights and gathers a
block's for its forward. The run must still be the one-process run, in float64 within 1e-9,
and rank 0 must say the teacher is sharded and holds about half of its bytes, and that it read
about half of the teacher's weights (built on meta, each rank reads its slices). The student
(with its projections) is built on meta too, each rank materialising its shards by the module
rule, as the one process does: the same values, said on the model's line.

Both runs are the session's `trained` runs (harness.run_job: the workers' own entry), one
job per world size; rank 0's output is each case's captured stdout and stderr.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from test_distill_parity import BERT_STUDENT, TOL, save_bert_teacher

from harness import Case, assert_planner_bytes_match, load_weights, losses, max_abs_diff

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

READ_LINE = re.compile(r"([\d.]+) MiB of its weights read")
TEACHER_LINE = re.compile(r"distillation teacher .*?([\d.]+) MiB on this rank \((\w+)")
MODEL_LINE = re.compile(
    r"model: [\d,]+ parameters on this rank \(model.name = 'hf', built (on meta|whole)\)"
)


def test_fsdp_shards_the_teacher_and_matches_one_process(trained, tmp_path: Path) -> None:
    teacher = save_bert_teacher(tmp_path / "bert-teacher")
    common = [
        f"distill.teacher={teacher}",
        "distill.init_layers=[]",  # the student and the teacher are then built on meta
        "train.global_batch=16",
        "train.micro_batch=4",
        "log.quiet=false",
    ]  # the teacher's line is a message
    one = trained({"one": Case.of(BERT_STUDENT, *common, "parallel.dp=1")}, world_size=1)["one"]
    fsdp = trained(
        {"fsdp": Case.of(BERT_STUDENT, *common, "parallel.dp=1", "parallel.dp_shard=2")},
        world_size=2,
    )["fsdp"]
    # The planner's bytes (issue 20): the student with its projections, sharded, to the byte.
    assert_planner_bytes_match(fsdp.run_dir, world_size=2)
    diff = max_abs_diff(load_weights(one.run_dir), load_weights(fsdp.run_dir))
    print(f"dp_shard=2 vs 1 process: max |difference| {diff:.3g}")
    assert diff < TOL
    assert losses(fsdp.run_dir) == pytest.approx(losses(one.run_dir), abs=TOL, rel=TOL)
    # Saved shard by shard (each rank its student's shards, rank 0 joins them), the student's
    # directory is the one process's: the same files, the tokenizer and pooling included.
    one_files, fsdp_files = (
        sorted(p.name for p in (run.run_dir / "hf-model").rglob("*")) for run in (one, fsdp)
    )
    assert fsdp_files == one_files and "tokenizer.json" in one_files, (one_files, fsdp_files)
    # The student too (issue 19): on meta in both, rank 0's shards drawn as one process's.
    assert MODEL_LINE.findall(one.stderr[0]) == MODEL_LINE.findall(fsdp.stderr[0]) == ["on meta"]
    ((whole_mib, whole_kind),) = TEACHER_LINE.findall(one.stdout[0] + one.stderr[0])
    ((shard_mib, shard_kind),) = TEACHER_LINE.findall(fsdp.stdout[0] + fsdp.stderr[0])
    assert (whole_kind, shard_kind) == ("replicated", "sharded")
    # Half of every sharded parameter, rounded up per tensor (dim 0 split in 2).
    assert float(shard_mib) == pytest.approx(float(whole_mib) / 2, rel=0.05)
    # Built on meta and read in slices (issue 19): rank 0 read about half of the weights'
    # bytes in the teacher's files; the one-process teacher was loaded whole (no line).
    (read_mib,) = READ_LINE.findall(fsdp.stdout[0] + fsdp.stderr[0])
    assert not READ_LINE.findall(one.stdout[0] + one.stderr[0])
    file_mib = (
        sum(
            t.numel() * t.element_size()
            for f in teacher.glob("*.safetensors")
            for t in load_file(f).values()
        )
        / 2**20
    )
    assert float(read_mib) == pytest.approx(file_mib / 2, rel=0.05)
