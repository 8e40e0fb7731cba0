"""Hardware profiles: what a device computes and moves per second, for the planner's step
time and every run's MFU.

A profile (a TOML table `scaletrain calibrate` writes, or a GPU part below) holds matmul
FLOP/s per dtype, memory and its bandwidth, and the collectives' bus bandwidth and latency
per world size. MFU divides a run's model FLOPs by the peak of its compute dtype: on a CPU
what calibrate measured, on a GPU the part's dense datasheet figure (torchtitan's, Megatron's).

Which profile a run uses: `SCALETRAIN_HARDWARE` (a built-in name or a path), else the
built-in of the CUDA device's part (its name matched whole, its memory the device's), else
on a CPU this machine's calibrated profile (CALIBRATED), else none (MFU is logged as null).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from pydantic import ConfigDict, TypeAdapter, ValidationError

from scaletrain.errors import UserError

CALIBRATED = Path.home() / ".cache" / "scaletrain" / "hardware.toml"


@dataclass(frozen=True)
class Link:
    """One collective's cost model: seconds = latency_s + bytes on the wire / bus_bw. Each
    field: its unit, then how it is measured (calibrate) or set (a GPU part)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a link's unknown key is an error

    bus_bw: float  # bytes/s: nccl-tests' busbw; calibrate's fit of gloo collectives, a datasheet's
    latency_s: float  # s: a collective's time at no bytes, fitted; a GPU's: NCCL's model
    fsdp_call_s: float = 0.0  # s a call: FSDP2's cost beyond its bytes, fitted; 0: latency_s
    tp_call_s: float = 0.0  # s a call: the same for DTensor (tensor parallelism)
    fsdp_pair_call_s: float = 0.0  # s a call: fsdp_call_s in a group of 2 of this world
    tp_pair_call_s: float = 0.0  # s a call: the same for DTensor; 0 (both): the world's
    fsdp_pair_step_s: float = 0.0  # s a step: FSDP2's cost once a step, fitted with the pair's
    tp_pair_step_s: float = 0.0  # s a step: the same for DTensor
    fsdp_rss: int = 0  # bytes: what a CPU rank adds on its first FSDP2 steps, measured


@dataclass(frozen=True)
class Profile:
    """What a device computes and moves per second, and the costs planner/reference.py
    fits. Each field: its unit, then how calibrate measures it or a GPU part sets it."""

    name: str  # "this-machine" (calibrate) or the built-in part's name
    flops: dict[str, float]  # FLOP/s by dtype: a device's, or one CPU core's matmuls, timed
    memory_bytes: int  # bytes a device: MemTotal, or the GPU's memory
    memory_bw: float  # bytes/s a device streams: a 128 MiB copy, timed
    intra: dict[int, Link] = field(default_factory=dict)  # world size -> Link within a node;
    # an unlisted size takes the one below
    inter: Link | None = None  # between nodes: a device's share of the node's NICs
    devices_per_node: int = 1  # devices: a GPU node's
    overlap: bool = False  # collectives overlap compute (GPU streams; gloo: no)
    cores: int = 0  # cores this process may use (sched_getaffinity); 0: a GPU profile
    op_s: float = 0.0  # s a forward op: dispatch and autograd of it and its backward, fitted
    # s a byte a forward's ops write, backward included, fitted with op_s; a GPU's: 6 bytes
    # of traffic per byte written at its memory bandwidth
    byte_s: float = 0.0
    rss_ratio: float = 1.0  # resident bytes per live tensor byte under DDP (CPU), settled
    fsdp_rss_per_byte: float = 0.0  # resident bytes per parameter byte a settled FSDP2 rank adds
    tp_rss_ratio: float = 1.0  # rss_ratio under tensor parallelism, settled
    fsdp_step_s: float = 0.0  # s a step: FSDP2's cost once a step beyond its calls, 2 ranks
    tp_step_s: float = 0.0  # s a step: the same for DTensor
    # share of `flops` a matmul reaches, for step times (MFU stays against flops): a GPU's
    # Maximum Achievable Matmul FLOPS over its peak; 1 on a CPU
    matmul_efficiency: float = 1.0
    # cores: the most foreign load (runtime/load.py) calibrate saw while it measured; above
    # NOISY_CORES the profile is marked as taken on a busy machine
    foreign_cores: float = 0.0
    steal_cores: float = 0.0  # cores: the same for steal (another VM's time on this host)
    source: str = ""  # where the figures come from

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

    def ranks_per_node(self, world_size: int) -> int:
        """Ranks on one node where `world_size` ranks launch with the default --nproc: on a
        CPU all of them on this machine; on a GPU one a device, up to a node's devices."""
        return world_size if self.cores else min(world_size, self.devices_per_node)

    def slowdown(self, ranks_per_node: int) -> float:
        """How much longer a rank's serial work takes when its node's ranks outnumber the
        cores (they take turns); 1 on a GPU."""
        return max(1.0, ranks_per_node / self.cores) if self.cores else 1.0


# ------------------------------------------------------------------------ the GPU parts
# Bus bandwidth per GPU is one direction's: half the datasheet's bidirectional figure.
NVLINK_600 = 300e9  # A100 SXM4 NVLink 3, and the H100 NVL's NVLink bridge: 600 GB/s
NVLINK_900 = 450e9  # H100 / H200 SXM NVLink 4, and the H200 NVL's bridge: 900 GB/s
PCIE_GEN4 = 32e9  # PCIe Gen4 x16: 64 GB/s (A100 datasheet)
PCIE_GEN5 = 64e9  # PCIe Gen5 x16: 128 GB/s (H100, H200 datasheets)
IB_HDR = 25e9  # one 200 Gb/s HDR NIC per GPU (a DGX A100's), bytes/s
IB_NDR = 50e9  # one 400 Gb/s NDR NIC per GPU (a DGX H100's)
# Latencies: estimates, not measurements, of the order of NCCL's own model (NVIDIA/nccl
# src/graph/tuning.cc: an LL all-reduce takes 6.6 us plus 0.6 a step over NVLink, 1.0 over
# PCIe, 5.0 a tree's network hop: 7.8-8.6 us on 2 GPUs, 15 on 8, 25 on 2 nodes of 8).
LATENCY_2, LATENCY_MORE, LATENCY_NODES = 10e-6, 15e-6, 20e-6

# Datasheet rates, dense, FLOP/s: fp64 the FP64 Tensor Core figure (a float64 matmul's),
# fp32 the plain FP32 one (an fp32 matmul's unless precision.tf32 allows the TF32 cores), tf32
# and bf16 (fp16 the same) the tensor cores'. The H100 and H200 datasheets give FP32 equal to
# FP64 Tensor Core, and TF32 and BF16 with sparsity, halved here; the A100's are dense.
A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web)"
H100_PCIE = "NVIDIA H100 Tensor Core GPU datasheet (2022 edition: H100 SXM and H100 PCIe)"
H100_NVL = "NVIDIA H100 Tensor Core GPU datasheet (2023 edition: H100 SXM and H100 NVL)"
H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024: H200 SXM and H200 NVL)"
RATES = {  # fp64, fp32, tf32, bf16
    "a100": (19.5e12, 19.5e12, 156e12, 312e12),
    "sxm": (67e12, 67e12, 989e12 / 2, 1979e12 / 2),
    "nvl": (60e12, 60e12, 835e12 / 2, 1671e12 / 2),
    "pcie": (51e12, 51e12, 756e12 / 2, 1513e12 / 2),
}
# The best bf16 matmul rate measured over the datasheet peak, for every dtype (step times use
# it; MFU stays against the peak, as torchtitan and Megatron-LM report it): Stas Bekman's
# Maximum Achievable Matmul FLOPS (github.com/stas00/ml-engineering, compute/accelerator/
# README.md, v2 BF16 table: mean of 100 iterations of the best shape, torch 2.6-2.7) for the
# A100 and H100 SXM; other parts take their SXM sibling's (same die, clocks in the peak).
A100_SHARE = 271.2e12 / 312e12  # A100 SXM: 86.9%, torch 2.6.0+cu126
H100_SHARE = 794.5e12 / 989.5e12  # H100 SXM: 80.3%, torch 2.7.0+cu126

# A part a row: name; torch.cuda.get_device_name(), matched whole ("NVIDIA H100 NVL"
# contains "H100" and is another part); datasheet and column; RATES; memory in the sheet's
# "GB", which are GiB (an A100 80GB reports 81920 MiB; a known device's own replaces it);
# the column's GPU Memory Bandwidth; a node's 8 GPUs: "nvswitch" (all on NVLink), "pcie"
# (cards, an optional bridge not counted), "pairs" (NVLink-bridged pairs meeting over PCIe;
# the H200 NVL's 4-way bridge planned as the 2-way one); the NVLink's bus bandwidth.
# fmt: off
PART_ROWS = (
    ("a100-sxm4-40gb", "NVIDIA A100-SXM4-40GB", A100, "A100 40GB SXM", "a100", 40, 1.555e12, "nvswitch", NVLINK_600),
    ("a100-sxm4-80gb", "NVIDIA A100-SXM4-80GB", A100, "A100 80GB SXM", "a100", 80, 2.039e12, "nvswitch", NVLINK_600),
    ("a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", A100, "A100 40GB PCIe", "a100", 40, 1.555e12, "pcie", None),
    ("a100-pcie-80gb", "NVIDIA A100 80GB PCIe", A100, "A100 80GB PCIe", "a100", 80, 1.935e12, "pcie", None),
    ("h100-sxm", "NVIDIA H100 80GB HBM3", H100_NVL, "H100 SXM", "sxm", 80, 3.35e12, "nvswitch", NVLINK_900),
    ("h100-pcie", "NVIDIA H100 PCIe", H100_PCIE, "H100 PCIe", "pcie", 80, 2.0e12, "pcie", None),
    ("h100-nvl", "NVIDIA H100 NVL", H100_NVL, "H100 NVL", "nvl", 94, 3.9e12, "pairs", NVLINK_600),
    ("h200-sxm", "NVIDIA H200", H200, "H200 SXM", "sxm", 141, 4.8e12, "nvswitch", NVLINK_900),
    ("h200-nvl", "NVIDIA H200 NVL", H200, "H200 NVL", "nvl", 141, 4.8e12, "pairs", NVLINK_900),
)
# fmt: on


def _part(name, _device, sheet, column, rates, memory_gb, memory_bw, node, nvlink) -> Profile:
    """A part's profile from its row: A100s on PCIe Gen4 and HDR InfiniBand, Hoppers on Gen5, NDR."""
    fp64, fp32, tf32, bf16 = RATES[rates]
    a100 = rates == "a100"
    pcie = PCIE_GEN4 if a100 else PCIE_GEN5
    near = pcie if node == "pcie" else nvlink
    return Profile(
        name=name,
        flops={"fp64": fp64, "fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16},
        memory_bytes=int(memory_gb * 2**30),
        memory_bw=memory_bw,
        intra={2: Link(near, LATENCY_2)}
        | ({3: Link(pcie, LATENCY_MORE)} if node == "pairs" else {8: Link(near, LATENCY_MORE)}),
        inter=Link(IB_HDR if a100 else IB_NDR, LATENCY_NODES),
        devices_per_node=8,
        overlap=True,
        byte_s=6 / memory_bw,  # written, then read and written again by the backward
        matmul_efficiency=A100_SHARE if a100 else H100_SHARE,
        source=f"{sheet}, {column}",
    )


PARTS = {row[0]: _part(*row) for row in PART_ROWS}
DEVICE_NAMES = {device: name for name, device, *_ in PART_ROWS}
# the names `--hardware` took before the parts were told apart: the SXM parts they meant
ALIASES = {"a100": "a100-sxm4-80gb", "h100": "h100-sxm", "h200": "h200-sxm"}
BUILTIN = {**PARTS, **{alias: PARTS[part] for alias, part in ALIASES.items()}}


class ProfileError(UserError):
    pass


def load_profile(name_or_path: str) -> Profile:
    """A built-in by name (a key of BUILTIN, any case) or a profile TOML's path. A profile's
    unknown keys (another version's, as rss_fixed) are skipped; a link's are an error."""
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
        data = {"source": str(path), **tomllib.loads(path.read_text())}
        profile = TypeAdapter(Profile).validate_python(data)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"hardware profile {path} is not valid TOML ({e})") from None
    except ValidationError as e:
        wrong = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ProfileError(
            f"hardware profile {path}: missing or wrong key ({wrong}); a profile another "
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

    # JSON mode writes intra's sizes as the strings TOML's keys are; no inter: no table
    return tomli_w.dumps(TypeAdapter(Profile).dump_python(profile, mode="json", exclude_none=True))


def default_profile(device_type: str) -> Profile | None:
    """This run's profile (module docstring), or None where none is known."""
    chosen = os.environ.get("SCALETRAIN_HARDWARE")
    if chosen:
        return load_profile(chosen)
    if device_type == "cuda":
        return device_profile()
    return load_profile(str(CALIBRATED)) if CALIBRATED.is_file() else None


def device_profile(index: int | None = None) -> Profile | None:
    """The built-in profile of CUDA device `index`'s exact part (default: the current
    device), with the memory the device reports; None for a part not in DEVICE_NAMES."""
    import torch

    index = torch.cuda.current_device() if index is None else index
    part = DEVICE_NAMES.get(torch.cuda.get_device_name(index).strip())
    if part is None:
        return None
    profile = PARTS[part]
    memory = torch.cuda.get_device_properties(index).total_memory
    return replace(profile, memory_bytes=memory, source=f"{profile.source}; memory: the device's")


def rank_budget(profile: Profile | None, *, ranks_per_node: int) -> tuple[int, str]:
    """Bytes one rank may use, and where the figure comes from: a GPU's own memory; on a
    CPU the node's memory (the profile's, else this machine's) over the ranks it runs."""
    if profile is not None and not profile.cores:
        return profile.memory_bytes, f"{profile.name}'s memory"
    total = profile.memory_bytes if profile else total_memory()
    where = f"{profile.name}'s memory" if profile else "this machine's memory"
    return total // ranks_per_node, f"{where} over {ranks_per_node} rank(s)"


def total_memory() -> int:
    """This machine's memory in bytes (/proc/meminfo's MemTotal)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def cpu_name() -> str:
    """This CPU's model name (/proc/cpuinfo), or "this CPU" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return "this CPU"
