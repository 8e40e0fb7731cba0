"""Hardware profiles: what a device computes and moves per second, for the planner's step
time and every run's MFU.

A profile is a small TOML table (written by `scaletrain calibrate`, or one of the built-ins
below): peak matmul FLOP/s per dtype, memory per device, memory bandwidth, and the
collectives' bus bandwidth and latency per world size. MFU divides the model FLOPs a run
achieved by the profile's peak for the run's compute dtype; on a CPU the peak is what
`calibrate` measured (there is no datasheet figure a 2-core VM reaches), on a GPU the
datasheet's dense figure, as torchtitan and Megatron report it.

Which profile a run uses: `SCALETRAIN_HARDWARE` (a built-in name or a profile path), else
the built-in whose name is in the CUDA device's name, else the calibrated profile of this
machine (`~/.cache/scaletrain/hardware.toml`, what `scaletrain calibrate` writes), else none
(MFU is then logged as null and the start-up line says how to get one).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from scaletrain.errors import UserError

DTYPES = ("fp32", "bf16", "fp16", "fp64")
CALIBRATED = Path.home() / ".cache" / "scaletrain" / "hardware.toml"


@dataclass(frozen=True)
class Link:
    """One collective's cost model: seconds = latency_s + bytes on the wire / bus_bw."""

    bus_bw: float  # bytes/s of the ring's bus bandwidth (what nccl-tests call busbw)
    latency_s: float
    # seconds per collective call beyond its bytes, the framework's Python included, where
    # calibrate measured it (planner/reference.py); 0: latency_s
    fsdp_call_s: float = 0.0
    tp_call_s: float = 0.0
    # the same for a group of 2 among this world's ranks (the others in groups of their
    # own): where ranks outnumber cores, a call waits on fewer peers than the whole world's;
    # 0: the whole world's
    fsdp_pair_call_s: float = 0.0
    tp_pair_call_s: float = 0.0
    # FSDP2's / DTensor's cost once a step (the whole model's; a pipeline stage pays its
    # share) that goes with the pair's calls, fitted with them (used where they are)
    fsdp_pair_step_s: float = 0.0
    tp_pair_step_s: float = 0.0
    # CPU: resident bytes a rank adds on its first FSDP2 steps (the code and state it
    # loads), measured per world size by calibrate; 0 on a GPU
    fsdp_rss: int = 0


@dataclass(frozen=True)
class Profile:
    name: str
    flops: dict[str, float]  # dtype -> matmul FLOP/s of one device (rank)
    memory_bytes: int  # per device (rank)
    memory_bw: float  # bytes/s a device streams (the optimizer step, element-wise work)
    # world size -> Link; an unlisted size uses the nearest listed one below it
    intra: dict[int, Link] = field(default_factory=dict)  # within a node
    inter: Link | None = None  # between nodes (per device's share of the NIC)
    devices_per_node: int = 1
    overlap: bool = False  # do collectives overlap compute (GPU streams: yes; gloo on CPU: no)
    cores: int = 0  # a CPU profile: flops are per core, shared by the node's ranks; 0: a GPU
    # Beyond the matmuls and the collectives' bytes (calibrate fits these from real steps of
    # a reference model, planner/reference.py; a GPU's stay 0 but byte_s):
    op_s: float = 0.0  # seconds per forward op, its backward included (dispatch, autograd)
    byte_s: float = 0.0  # seconds per byte the forward's ops write, backward included
    rss_fixed: float = 0.0  # CPU: resident bytes a training step adds beyond live tensors
    rss_ratio: float = 1.0  # CPU: resident bytes per live tensor byte (the allocator's slack)
    # CPU: what a rank under FSDP2 holds once its steps have settled, beyond the links'
    # fsdp_rss, per byte of the stage's whole parameters (the heap's holes around its
    # gathered buffers), measured by calibrate on the configured model's own sharded steps
    # (planner/reference.py)
    fsdp_rss_per_byte: float = 0.0
    # CPU: resident bytes per live tensor byte of a rank under tensor parallelism once its
    # steps have settled (DTensor's slack: its gathered and scattered copies of the stream
    # leave holes between the activations), measured the same way
    tp_rss_ratio: float = 1.0
    # CPU: what FSDP2 / DTensor cost once a step beyond their calls, for the whole model's
    # parameters, measured by calibrate on the configured model's own sharded steps on 2
    # ranks (planner/reference.py)
    fsdp_step_s: float = 0.0
    tp_step_s: float = 0.0
    # the share of `flops` a matmul reaches, for the planner's step time (MFU stays against
    # `flops`): a GPU's measured Maximum Achievable Matmul FLOPS over its datasheet peak; 1 on
    # a CPU, whose `flops` calibrate measured at the model's own shapes
    matmul_efficiency: float = 1.0
    # CPU: one round of calibrate's reference, its micro-batches' median steps summed (the
    # slowest of its ranks side by side each), seconds: how fast this machine ran when it was
    # measured, against which a later timing of the same round tells how much its speed has
    # moved since (a shared VM's moves by a quarter from minute to minute); 0: not measured
    reference_round_s: float = 0.0
    source: str = ""

    def link(self, group_size: int, *, spans_nodes: bool = False) -> Link:
        if spans_nodes and self.inter is not None:
            return self.inter
        sizes = sorted(s for s in self.intra if s <= max(group_size, min(self.intra)))
        return self.intra[sizes[-1]]

    def peak(self, dtype: str, *, ranks_per_node: int = 1) -> float | None:
        """Matmul FLOP/s of one rank: a GPU's own; on a CPU the node's cores shared by its
        ranks (each gets max(1, cores // ranks) threads; more ranks than cores take turns)."""
        rate = self.flops.get(dtype)
        if rate is None or not self.cores:
            return rate
        threads = max(1, self.cores // ranks_per_node)
        return rate * threads * min(1.0, self.cores / (threads * ranks_per_node))

    def slowdown(self, ranks_per_node: int) -> float:
        """How much longer a rank's serial work takes when its node's ranks outnumber the
        cores (they take turns); 1 on a GPU."""
        return max(1.0, ranks_per_node / self.cores) if self.cores else 1.0


def _gpu(name, *, bf16, fp32, mamf, memory_gib, memory_bw, nvlink, ib, source) -> Profile:
    # NVLink's bus bandwidth per GPU is its one-direction figure; latency ~10 us (nccl-tests)
    return Profile(
        name=name,
        flops={"bf16": bf16, "fp16": bf16, "fp32": fp32, "fp64": fp32 / 2},
        memory_bytes=int(memory_gib * 2**30),
        memory_bw=memory_bw,
        intra={2: Link(nvlink, 10e-6), 8: Link(nvlink, 15e-6)},
        inter=Link(ib, 20e-6),
        devices_per_node=8,
        overlap=True,
        # element-wise work: a forward op's output written, then read and written again by
        # the backward (about 6 bytes of traffic per byte written), at the HBM's bandwidth
        byte_s=6 / memory_bw,
        matmul_efficiency=mamf / bf16,
        source=source,
    )


# Datasheet figures (dense, no sparsity). fp32 is the TF32 tensor-core rate torch uses with
# `torch.backends.cuda.matmul.allow_tf32`; plain fp32 is lower. `mamf`: the best bf16 matmul
# rate measured on the part (its share of the peak applies to every dtype), from Stas
# Bekman's Maximum Achievable Matmul FLOPS table (github.com/stas00/ml-engineering,
# compute/accelerator/README.md, the v2 BF16 table: the mean of 100 iterations of the best
# shape found, torch 2.6-2.7). No datasheet rate is reached by a real matmul; the planner
# times matmuls at this one and reports MFU against the datasheet's, as torchtitan and
# Megatron-LM do.
BUILTIN = {
    "a100": _gpu(
        "a100",
        bf16=312e12,
        fp32=156e12,
        mamf=271.2e12,  # 86.9%, torch 2.6.0+cu126
        memory_gib=80,
        memory_bw=2.039e12,
        nvlink=300e9,  # NVLink 3: 600 GB/s bidirectional
        ib=25e9,  # one 200 Gb/s HDR NIC per GPU
        source="NVIDIA A100 datasheet (SXM4 80GB), 2021",
    ),
    "h100": _gpu(
        "h100",
        bf16=989e12,
        fp32=494e12,
        mamf=794.5e12,  # 80.3%, torch 2.7.0+cu126
        memory_gib=80,
        memory_bw=3.35e12,
        nvlink=450e9,  # NVLink 4: 900 GB/s bidirectional
        ib=50e9,  # one 400 Gb/s NDR NIC per GPU
        source="NVIDIA H100 datasheet (SXM5), 2023",
    ),
    "h200": _gpu(
        "h200",
        bf16=989e12,
        fp32=494e12,
        mamf=794.5e12,  # the H100 SXM's: the same GH100 die and clocks (no H200 row yet)
        memory_gib=141,
        memory_bw=4.8e12,
        nvlink=450e9,
        ib=50e9,
        source="NVIDIA H200 datasheet (SXM), 2024",
    ),
}


_FLOAT_KEYS = (
    "op_s",
    "byte_s",
    "rss_fixed",
    "rss_ratio",
    "fsdp_rss_per_byte",
    "tp_rss_ratio",
    "fsdp_step_s",
    "tp_step_s",
    "matmul_efficiency",
    "reference_round_s",
)


class ProfileError(UserError):
    pass


def load_profile(name_or_path: str) -> Profile:
    """A built-in by name (a100, h100, h200) or a profile TOML's path."""
    key = name_or_path.lower()
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ProfileError(
            f"hardware profile {name_or_path!r} is neither a built-in "
            f"({', '.join(BUILTIN)}) nor a file; `scaletrain calibrate` writes one"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"hardware profile {path} is not valid TOML ({e})") from None
    try:
        profile = Profile(
            name=data["name"],
            flops={k: float(v) for k, v in data["flops"].items()},
            memory_bytes=int(data["memory_bytes"]),
            memory_bw=float(data["memory_bw"]),
            intra={int(k): Link(**v) for k, v in data.get("intra", {}).items()},
            inter=Link(**data["inter"]) if "inter" in data else None,
            devices_per_node=int(data.get("devices_per_node", 1)),
            overlap=bool(data.get("overlap", False)),
            cores=int(data.get("cores", 0)),
            **{k: float(data[k]) for k in _FLOAT_KEYS if k in data},
            source=data.get("source", str(path)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(
            f"hardware profile {path}: missing or wrong key ({e}); a profile another "
            "version of `scaletrain calibrate` wrote: run it again"
        ) from None
    if not 0 < profile.matmul_efficiency <= 1:
        raise ProfileError(
            f"hardware profile {path}: matmul_efficiency = {profile.matmul_efficiency} is the "
            "share of the peak a matmul reaches: more than 0, at most 1"
        )
    return profile


def profile_toml(profile: Profile) -> str:
    import tomli_w

    data = asdict(profile)
    data["intra"] = {str(k): v for k, v in data["intra"].items()}
    if data["inter"] is None:
        del data["inter"]
    return tomli_w.dumps(data)


def slowed(profile: Profile, factor: float) -> Profile:
    """`profile` on a machine `factor` times as slow: every rate over it (matmul FLOP/s,
    memory and bus bandwidth), every time cost times it (latency, the costs per call, per
    step, per op and per byte, the reference round); memory untouched. Every step the
    planner predicts with it is `factor` times as long."""
    timed = (
        "fsdp_call_s",
        "tp_call_s",
        "fsdp_pair_call_s",
        "tp_pair_call_s",
        "fsdp_pair_step_s",
        "tp_pair_step_s",
        "latency_s",
    )

    def link(x: Link) -> Link:
        return replace(x, bus_bw=x.bus_bw / factor, **{k: getattr(x, k) * factor for k in timed})

    costs = ("op_s", "byte_s", "fsdp_step_s", "tp_step_s", "reference_round_s")
    return replace(
        profile,
        flops={k: v / factor for k, v in profile.flops.items()},
        memory_bw=profile.memory_bw / factor,
        intra={w: link(x) for w, x in profile.intra.items()},
        inter=link(profile.inter) if profile.inter else None,
        **{k: getattr(profile, k) * factor for k in costs},
    )


def default_profile(device_type: str) -> Profile | None:
    """This run's profile (module docstring), or None where none is known."""
    chosen = os.environ.get("SCALETRAIN_HARDWARE")
    if chosen:
        return load_profile(chosen)
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name().lower()
        return next((p for key, p in BUILTIN.items() if key in name), None)
    return load_profile(str(CALIBRATED)) if CALIBRATED.is_file() else None
