"""FSDP2 holds what it promises: each rank's share of parameters, gradients and optimizer
state, and whole parameters between forward and backward only under ZeRO-2.

1. From the runs' metrics (param_bytes, grad_bytes, optim_state_bytes: rank 0's local
   tensor bytes): under dp_shard=2 every tensor is half the one-process one (ZeRO-3 and
   ZeRO-2 alike: between steps ZeRO-2 has resharded too); under tp=2 only the planned
   Linear layers are split (and the head, by vocabulary, with sequence parallelism), the
   embeddings and norms stay whole; under dp_shard=2 x tp=2 every parameter is halved over
   dp_shard and the tensor-parallel ones halved again over tp. The expected bytes are
   computed from the GPT's parameter shapes, its TP plan and its sequence split, not
   guessed: for the "small" GPT the 2-D layout holds 26% of the model per rank, not 25%.
2. Directly, in two gloo processes: after one forward, a (non-last) block's registered
   parameters are whole plain tensors under reshard_after_forward=False (ZeRO-2) and 1/2
   DTensor shards again under True (ZeRO-3); after backward both hold shards.
3. The final save (finish.save_split_weights) of a sharded model writes the whole model,
   exactly, with no rank ever holding it: each rank writes its own shards (DCP's Hugging
   Face writer, a file per tensor) and rank 0 joins them one tensor at a time, so both
   ranks' peak resident memory during the save (VmHWM, reset just before) stays under half
   the model's bytes. Gathering the state dict to rank 0, as the save once did, put all of
   it there.

Run as a script (`python test_fsdp_memory.py DIR`, with torchrun's environment), this file is
the worker of tests 2 and 3 (one job: ZeRO-2's probe, ZeRO-3's, then the save's) and prints
its observations as one JSON line.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from harness import Case, cli_env, free_port, records

TIMEOUT = 240.0  # per run: the machine is shared with other multi-process tests
F64 = 8  # bytes per element: the runs are fp64

CONFIG = """
[model]
name = "gpt"
size = "small"        # 4 blocks, 4 heads, n_embd 128
[data]
source = "wikitext"
seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 2
[train]
steps = 1
seed = 7
global_batch = 16
micro_batch = 4
eval_examples = 16
[log]
every = 1
quiet = true
[precision]
mode = "fp64"
"""

# name -> (world size, dp_shard, tp, sequence parallel, overrides)
LAYOUTS = {
    "dp_shard2": (2, 2, 1, False, ["parallel.dp_shard=2"]),
    "dp_shard2-zero2": (
        2,
        2,
        1,
        False,
        ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
    ),
    # Plain Megatron TP: the head stays whole on every tensor-parallel rank.
    "tp2-no_sp": (2, 1, 2, False, ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    # With sequence parallelism the head is split by columns (vocabulary) too.
    "dp_shard2xtp2-sp": (
        4,
        2,
        2,
        True,
        ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
}


def _gpt(device: str | torch.device = "cpu"):
    from scaletrain.models.gpt import GPT, GPT_SHAPES

    with torch.device(device):
        return GPT(vocab_size=256, block_size=32, shape=GPT_SHAPES["small"])


def _chunk(n: int, parts: int) -> int:
    """Rank 0's length of a dim of n split in `parts` (torch.chunk: ceil(n / parts))."""
    return -(-n // parts)


def expected_local_numel(*, dp_shard: int, tp: int, sequence_parallel: bool = False) -> int:
    """Rank 0's parameter elements, from the GPT's shapes and its TP plan: a colwise Linear
    splits weight and bias by output features (dim 0), a rowwise one its weight by input
    features (dim 1) and keeps its bias whole; sequence parallelism adds the head, split by
    columns; FSDP then splits every tensor on dim 0."""
    from scaletrain.models.gpt import GPT

    model = _gpt("meta")
    spec = GPT.scaletrain_spec
    plan = dict(spec.tp_plan)
    if sequence_parallel and spec.sequence is not None and spec.sequence.head:
        plan[spec.sequence.head] = "colwise"
    total = 0
    for name, p in model.named_parameters():
        shape = list(p.shape)
        module, _, kind = name.rpartition(".")
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(module, pat)), None)
        if tp > 1 and style == "colwise":
            shape[0] = _chunk(shape[0], tp)
        elif tp > 1 and style == "rowwise" and kind == "weight":
            shape[1] = _chunk(shape[1], tp)
        shape[0] = _chunk(shape[0], dp_shard)
        total += int(torch.Size(shape).numel())
    return total


@pytest.fixture(scope="module")
def runs(trained) -> dict[str, dict]:
    """The first (only) train record of one process and of each layout: one job per world
    size (conftest's `trained`)."""
    layouts = {"one-process": (1, []), **LAYOUTS}
    out = {}
    for world in sorted({w for w, *_ in layouts.values()}):
        cases = {
            name: Case.of(CONFIG, *overrides)
            for name, (w, *_, overrides) in layouts.items()
            if w == world
        }
        for name, result in trained(cases, world_size=world, timeout=TIMEOUT).items():
            (out[name],) = records(result.run_dir)
    return out


def _held(record: dict) -> int:
    return record["param_bytes"] + record["grad_bytes"] + record["optim_state_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_holds_its_share(runs: dict[str, dict], name: str) -> None:
    _, dp_shard, tp, sequence_parallel, _ = LAYOUTS[name]
    ref, got = runs["one-process"], runs[name]
    full = expected_local_numel(dp_shard=1, tp=1) * F64
    assert ref["param_bytes"] == ref["grad_bytes"] == full
    # AdamW: exp_avg and exp_avg_sq like each parameter, plus one scalar `step` per
    # parameter tensor, which no layout shards (it is a plain tensor on every rank).
    steps = ref["optim_state_bytes"] - 2 * full
    assert 0 < steps <= 8 * len(list(_gpt("meta").parameters())), steps

    local = (
        expected_local_numel(dp_shard=dp_shard, tp=tp, sequence_parallel=sequence_parallel) * F64
    )
    print(
        f"{name}: rank 0 holds {_held(got)} of {_held(ref)} bytes "
        f"({_held(got) / _held(ref):.4f}; params {got['param_bytes'] / full:.4f})"
    )
    assert got["param_bytes"] == local, (got["param_bytes"], local)
    assert got["grad_bytes"] == local, (got["grad_bytes"], local)
    assert got["optim_state_bytes"] == 2 * local + steps, (got["optim_state_bytes"], local)
    if tp == 1:  # pure ZeRO: 1/dp_shard of everything (the `step` scalars are 0.002%)
        assert _held(got) == pytest.approx(_held(ref) / dp_shard, rel=0.05)


# ---------------------------------------------------------------- ZeRO-2 versus ZeRO-3


def _job(run_dir: Path) -> dict:
    """One rank of tests 2 and 3, in one process group: the probe under ZeRO-2, then under
    ZeRO-3 (each a GPT of its own), then the final save's probe."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    seen = {f"zero{z}": _probe(z == 3, mesh) for z in (2, 3)}
    seen["save"] = _save_probe(mesh, run_dir)
    dist.destroy_process_group()
    return seen


def _probe(reshard_after_forward: bool, mesh) -> dict:
    """One rank of the direct test: shard the GPT, run forward and backward, and note what
    each block's registered parameters are at each point."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from scaletrain.parallel.fsdp import apply_fsdp
    from scaletrain.records.memory import local_bytes

    torch.manual_seed(0)  # the same model on both ranks
    model = _gpt()
    blocks = list(model.blocks.values())
    full_bytes = local_bytes(blocks[0].parameters())  # every block has the same shapes
    full_q = list(blocks[0].attn.q.weight.shape)
    apply_fsdp(
        model,
        mesh,
        blocks=blocks,
        mp_policy=MixedPrecisionPolicy(),
        reshard_after_forward=reshard_after_forward,
        offload=False,
    )

    def look() -> list[dict]:
        return [
            {
                "q_type": type(b.attn.q.weight).__name__,
                "q_shape": list(b.attn.q.weight.shape),  # global shape for a DTensor
                "q_local_shape": list(
                    b.attn.q.weight.to_local().shape
                    if isinstance(b.attn.q.weight, DTensor)
                    else b.attn.q.weight.shape
                ),
                "any_dtensor": any(isinstance(p, DTensor) for p in b.parameters()),
                "all_dtensor": all(isinstance(p, DTensor) for p in b.parameters()),
                "local_bytes": local_bytes(b.parameters()),
            }
            for b in blocks
        ]

    seen = {"full_bytes": full_bytes, "full_q": full_q, "init": look()}
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    logits = model(x)  # (B, T, V)
    seen["after_forward"] = look()
    logits.float().pow(2).mean().backward()
    seen["after_backward"] = look()
    return seen


def _save_probe(mesh, run_dir: Path) -> dict:
    """One rank of test 3: shard 24 Linear layers (1 MiB of fp32 weight each), then save them
    as a run's final weights and measure this rank's peak resident memory meanwhile."""
    import gc

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from scaletrain.parallel.fsdp import apply_fsdp
    from scaletrain.records.memory import WindowPeak, local_bytes
    from scaletrain.training.finish import save_split_weights

    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(24)))
    full_bytes = local_bytes(layers.parameters())
    expected = {k: v.clone() for k, v in layers.state_dict().items()}
    apply_fsdp(
        layers,
        mesh,
        blocks=list(layers),
        mp_policy=MixedPrecisionPolicy(),
        reshard_after_forward=True,
        offload=False,
    )
    gc.collect()
    dist.barrier()
    window = WindowPeak.start()  # baseline: now; peak: from now
    save_split_weights(layers, run_dir=run_dir)
    peak_above = window.record()["window_peak_above_baseline_bytes"]
    saved = load_file(run_dir / "model.safetensors")
    return {
        "full_bytes": full_bytes,
        "peak_above": peak_above,
        "resettable": window.window_resettable,
        "keys": len(saved),
        "exact": saved.keys() == expected.keys()
        and all(torch.equal(saved[k], expected[k]) for k in saved),
    }


def _run_job() -> list[dict]:
    """Both ranks of the job (`_job`), as subprocesses with torchrun's environment and a
    timeout."""
    port, world_size = str(free_port()), 2
    run_dir = Path(tempfile.mkdtemp(prefix="fsdp-save-"))  # test 3's final weights
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(run_dir)],
            env=cli_env(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
                # glibc maps every block of 64 KiB or more on its own and unmaps it when
                # freed (a fixed threshold: no dynamic raise), so the resident memory
                # follows the live tensors, not how many freed heap pages get reused.
                MALLOC_MMAP_THRESHOLD_="65536",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outs = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, f"rank {rank} failed ({p.returncode}):\n{err[-3000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the FSDP probe did not finish within {TIMEOUT} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    """Both ranks' observations (`_job`), the job run once for the module."""
    return _run_job()


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3], ids=["zero2", "zero3"])
def test_reshard_after_forward(probes: list[dict], zero: int) -> None:
    for rank, seen in enumerate(job[f"zero{zero}"] for job in probes):
        full, full_q = seen["full_bytes"], seen["full_q"]
        half_q = [full_q[0] // 2, *full_q[1:]]
        print(
            f"ZeRO-{zero} rank {rank}: block bytes after forward "
            f"{[b['local_bytes'] for b in seen['after_forward']]} of {full} each"
        )
        for when in ("init", "after_backward"):  # between uses: 1/2 shards either way
            for i, b in enumerate(seen[when]):
                assert b["all_dtensor"] and b["q_local_shape"] == half_q, (when, i, b)
                assert b["local_bytes"] * 2 == full, (when, i, b)
        *middle, last = seen["after_forward"]
        for i, b in enumerate(middle):  # blocks 0..2: the ones reshard_after_forward governs
            if zero == 2:  # kept gathered for backward: whole plain tensors
                assert b["q_type"] != "DTensor" and not b["any_dtensor"], (i, b)
                assert b["q_shape"] == full_q and b["local_bytes"] == full, (i, b)
            else:  # freed after forward: back to this rank's half
                assert b["all_dtensor"] and b["q_local_shape"] == half_q, (i, b)
                assert b["local_bytes"] * 2 == full, (i, b)
        # apply_fsdp keeps the last block gathered under ZeRO-3 too: its backward is next.
        assert not last["any_dtensor"] and last["local_bytes"] == full, last


@pytest.mark.slow
def test_the_final_save_holds_the_whole_model_on_no_rank(probes: list[dict]) -> None:
    rank0, rank1 = (seen["save"] for seen in probes)
    full = rank0["full_bytes"]
    print(
        f"final save: peak above baseline rank 0 {rank0['peak_above']}, rank 1 "
        f"{rank1['peak_above']} bytes; the model {full}"
    )
    assert rank0["keys"] == 24 and rank0["exact"], rank0  # both ranks read the saved file
    if not rank1["resettable"]:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    # Each rank holds its shards' files being written and rank 0 one whole tensor at a time
    # while it joins them. This reads as resident memory only because the probe maps every
    # tensor on its own (MALLOC_MMAP_THRESHOLD_ in _run_probe).
    for seen in (rank0, rank1):
        assert seen["peak_above"] < 0.5 * full, seen


@pytest.mark.slow  # a subprocess, beside 1 GiB held here
def test_the_peak_is_the_process_own_not_its_parents() -> None:
    """Linux carries `ru_maxrss` over fork and exec: a worker started by a launcher that held
    the data and a model would report the launcher's peak as its own. `peak_mem_bytes` reads
    the process's own VmHWM: a child started while this process holds 1 GiB more reports
    far less than that."""
    held = bytearray(2**30)  # 1 GiB, touched: resident in this process
    held[::4096] = b"x" * (len(held) // 4096)
    probe = "from scaletrain.records.memory import lifetime_peak_bytes as p; print(p())"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    del held
    assert int(out.stdout) < 2**30, f"the child reports {int(out.stdout) / 2**20:.0f} MiB"


if __name__ == "__main__":
    from scaletrain.runtime import exit_worker

    print(json.dumps(_job(Path(sys.argv[1]))))
    exit_worker(0)  # without gloo's shutdown abort ("terminate called ..."), as a worker leaves
