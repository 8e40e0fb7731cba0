"""Hardware profiles: what a device computes and moves per second, for the planner's step
time and every run's MFU.

A profile is a small TOML table (written by `scaletrain calibrate`, or one of the built-ins
below): peak matmul FLOP/s per dtype, memory per device, memory bandwidth, and the
collectives' bus bandwidth and latency per world size. MFU divides the model FLOPs a run
achieved by the profile's peak for the run's compute dtype; on a CPU the peak is what
`calibrate` measured (no datasheet figure holds for a shared or virtual CPU), on a GPU the
datasheet's dense figure for the exact part, as torchtitan and Megatron report it (fp32 at
the plain FP32 rate, or the TF32 tensor cores' where precision.tf32 is on).

Which profile a run uses: `SCALETRAIN_HARDWARE` (a built-in name or a profile path), else
the built-in of the CUDA device's part, its name matched whole (DEVICE_NAMES) and its memory
the device's own, else on a CPU the calibrated profile of this machine
(`~/.cache/scaletrain/hardware.toml`, what `scaletrain calibrate` writes), else none (MFU is
then logged as null and the start-up line says how to get one). A built-in named without
its device (`scaletrain plan --hardware h100-nvl`) has the datasheet's memory.
"""

from __future__ import annotations

import os
import tomllib
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp64")
CALIBRATED = Path.home() / ".cache" / "scaletrain" / "hardware.toml"


def quantity(default: Any = MISSING, *, unit: str, how: str, scale: str = "none", factory=None):
    """A profile field, declared once: its default, its unit, how it is set, and how it scales
    on a machine some factor slower (`slowed`): "rate" (divided: FLOP/s, bytes/s), "time"
    (multiplied: seconds), "links" (each Link scaled), "none" (bytes, counts, names). Loading,
    writing and scaling a profile read these declarations, not lists of names."""
    meta = {"unit": unit, "how": how, "scale": scale}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Link:
    """One collective's cost model: seconds = latency_s + bytes on the wire / bus_bw."""

    bus_bw: float = quantity(
        unit="bytes/s",
        scale="rate",
        how="the ring's bus bandwidth (nccl-tests' busbw): calibrate fits all-reduce and "
        "all-gather times over 4 KiB..64 MiB; a GPU's from its datasheet",
    )
    latency_s: float = quantity(
        unit="s",
        scale="time",
        how="a collective's time at no bytes: the fastest of calibrate's smallest messages",
    )
    fsdp_call_s: float = quantity(
        0.0,
        unit="s per call",
        scale="time",
        how="FSDP2's cost per collective call beyond its bytes, its Python included, fitted "
        "on the configured model's sharded steps (planner/reference.py); 0: latency_s",
    )
    tp_call_s: float = quantity(
        0.0, unit="s per call", scale="time", how="the same for DTensor's tensor parallelism"
    )
    fsdp_pair_call_s: float = quantity(
        0.0,
        unit="s per call",
        scale="time",
        how="fsdp_call_s in a group of 2 among this world's ranks (where ranks outnumber "
        "cores a call waits on fewer peers than the world's); 0: the world's",
    )
    tp_pair_call_s: float = quantity(
        0.0, unit="s per call", scale="time", how="the same for tensor parallelism"
    )
    fsdp_pair_step_s: float = quantity(
        0.0,
        unit="s per step",
        scale="time",
        how="FSDP2's cost once a step (the whole model's; a pipeline stage pays its share) "
        "fitted with the pair's calls",
    )
    tp_pair_step_s: float = quantity(
        0.0, unit="s per step", scale="time", how="the same for tensor parallelism"
    )
    fsdp_rss: int = quantity(
        0,
        unit="bytes",
        how="CPU: resident bytes a rank adds on its first FSDP2 steps (code and state it "
        "loads), measured per world size on fresh ranks; 0 on a GPU",
    )


@dataclass(frozen=True)
class Profile:
    name: str = quantity(unit="", how="this-machine (calibrate) or the built-in part's name")
    flops: dict[str, float] = quantity(
        unit="FLOP/s by dtype",
        scale="rate",
        how="matmul rate of one device, or of one core on a CPU: calibrate times one thread "
        "at the model's linear shapes (1024^3 without a config); a GPU's datasheet",
    )
    memory_bytes: int = quantity(
        unit="bytes", how="per device: MemTotal, or the GPU's total_memory"
    )
    memory_bw: float = quantity(
        unit="bytes/s",
        scale="rate",
        how="what a device streams (the optimizer, element-wise work): a 128 MiB copy timed",
    )
    intra: dict[int, Link] = quantity(
        unit="world size -> Link",
        scale="links",
        factory=dict,
        how="within a node, per world size (an unlisted size uses the nearest below)",
    )
    inter: Link | None = quantity(
        None, unit="Link", scale="links", how="between nodes, a device's share of the NIC"
    )
    devices_per_node: int = quantity(1, unit="devices", how="a GPU node's devices")
    overlap: bool = quantity(
        False, unit="", how="do collectives overlap compute (GPU streams: yes; gloo on CPU: no)"
    )
    cores: int = quantity(
        0, unit="cores", how="a CPU profile: the cores this process may run on; 0: a GPU"
    )
    op_s: float = quantity(
        0.0,
        unit="s per forward op",
        scale="time",
        how="dispatch and autograd per op, its backward included: fitted from a reference "
        "model's real steps (planner/reference.py); 0 on a GPU",
    )
    byte_s: float = quantity(
        0.0,
        unit="s per byte written",
        scale="time",
        how="per byte a forward's ops write, backward included, fitted with op_s; a GPU's: "
        "6 bytes of traffic per byte written at its memory bandwidth",
    )
    rss_fixed: float = quantity(
        0.0, unit="bytes", how="CPU: resident bytes a step adds beyond live tensors"
    )
    rss_ratio: float = quantity(
        1.0,
        unit="bytes per live byte",
        how="CPU: resident bytes per live tensor byte (the allocator's slack), from the "
        "trainer's steps on 2 ranks under DDP",
    )
    fsdp_rss_per_byte: float = quantity(
        0.0,
        unit="bytes per parameter byte",
        how="CPU: what a rank under FSDP2 holds once its steps have settled, beyond the links' "
        "fsdp_rss, per byte of the stage's whole parameters, from the model's sharded steps",
    )
    tp_rss_ratio: float = quantity(
        1.0,
        unit="bytes per live byte",
        how="CPU: resident bytes per live byte of a rank under tensor parallelism once "
        "settled (DTensor's gathered and scattered copies), measured the same way",
    )
    fsdp_step_s: float = quantity(
        0.0,
        unit="s per step",
        scale="time",
        how="CPU: FSDP2's cost once a step beyond its calls, for the whole model's "
        "parameters, from the model's sharded steps on 2 ranks",
    )
    tp_step_s: float = quantity(0.0, unit="s per step", scale="time", how="the same for DTensor")
    matmul_efficiency: float = quantity(
        1.0,
        unit="share",
        how="of `flops` a matmul reaches (the planner's step time; MFU stays against flops): a "
        "GPU's Maximum Achievable Matmul FLOPS over its datasheet peak; 1 on a CPU, measured "
        "at the model's own shapes",
    )
    reference_round_s: float = quantity(
        0.0,
        unit="s",
        scale="time",
        how="CPU: one round of calibrate's reference steps, to tell later how much the "
        "machine's speed has moved since; 0: not measured",
    )
    calibrated_on: str = quantity(
        "", unit="", how="CPU: the model calibrate fitted the costs on (reference.model_label)"
    )
    source: str = quantity("", unit="", how="where the figures come from")

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


def _gpu(
    name: str,
    *,
    fp64: float,
    fp32: float,
    tf32: float,
    bf16: float,
    matmul_share: float,
    memory_gb: float,
    memory_bw: float,
    intra: dict[int, Link],
    ib: float,
    source: str,
) -> Profile:
    return Profile(
        name=name,
        flops={"fp64": fp64, "fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16},
        # the datasheet's "GB" of HBM are GiB (stacks come in binary sizes: an A100 80GB
        # reports 81920 MiB); used where the part is named without its device, whose own
        # total_memory replaces it (device_profile)
        memory_bytes=int(memory_gb * 2**30),
        memory_bw=memory_bw,
        intra=intra,
        inter=Link(ib, 20e-6),
        devices_per_node=8,
        overlap=True,
        # element-wise work: a forward op's output written, then read and written again by
        # the backward (about 6 bytes of traffic per byte written), at the HBM's bandwidth
        byte_s=6 / memory_bw,
        matmul_efficiency=matmul_share,
        source=source,
    )


def _links(*, near: float, far: float, near_group: int) -> dict[int, Link]:
    """A node of 8 GPUs: groups of up to `near_group` over `near` bus bandwidth (NVLink),
    larger ones over `far` (PCIe); latency ~10 us for 2 GPUs, 15 us for more (nccl-tests)."""
    if near_group >= 8:
        return {2: Link(near, 10e-6), 8: Link(near, 15e-6)}
    if near_group < 2:
        return {2: Link(far, 10e-6), 8: Link(far, 15e-6)}
    return {2: Link(near, 10e-6), near_group + 1: Link(far, 15e-6)}


# Bus bandwidth per GPU is one direction's: half the datasheet's bidirectional figure.
NVLINK_600 = 300e9  # A100 SXM4 NVLink 3, and the H100 NVL's NVLink bridge: 600 GB/s
NVLINK_900 = 450e9  # H100 / H200 SXM NVLink 4, and the H200 NVL's bridge: 900 GB/s
PCIE_GEN4 = 32e9  # PCIe Gen4 x16: 64 GB/s (A100 datasheet)
PCIE_GEN5 = 64e9  # PCIe Gen5 x16: 128 GB/s (H100, H200 datasheets)
IB_HDR = 25e9  # one 200 Gb/s HDR NIC per GPU (a DGX A100's), bytes/s
IB_NDR = 50e9  # one 400 Gb/s NDR NIC per GPU (a DGX H100's)

# Datasheet rates, dense (no sparsity). The A100's lists dense figures; the H100's and
# H200's list the tensor cores' with sparsity, halved here. fp64 is the FP64 Tensor Core
# figure (what a float64 matmul reaches on these parts; plain FP64 is half of it); fp32 is
# the non-tensor FP32 figure, what an fp32 matmul runs at unless precision.tf32 lets it use
# the TF32 tensor cores (tf32). `matmul_share`: the best bf16 matmul rate measured on the
# part over its datasheet peak, applied to every dtype, from Stas Bekman's Maximum
# Achievable Matmul FLOPS table (github.com/stas00/ml-engineering,
# compute/accelerator/README.md, the v2 BF16 table: the mean of 100 iterations of the best
# shape found, torch 2.6-2.7), which has the A100 SXM's and the H100 SXM's; the other parts
# take their SXM sibling's (the same die, at clocks their datasheet peak already counts).
# Memory bandwidth: each column's GPU Memory Bandwidth row. No datasheet rate is
# reached by a real matmul; the planner times matmuls at the share and reports MFU against
# the datasheet's, as torchtitan and Megatron-LM do.
A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web)"
H100_PCIE = "NVIDIA H100 Tensor Core GPU datasheet (2022 edition: H100 SXM and H100 PCIe)"
H100_NVL = "NVIDIA H100 Tensor Core GPU datasheet (2023 edition: H100 SXM and H100 NVL)"
H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024: H200 SXM and H200 NVL)"
A100_SHARE = 271.2e12 / 312e12  # A100 SXM: 86.9%, torch 2.6.0+cu126
H100_SHARE = 794.5e12 / 989.5e12  # H100 SXM: 80.3%, torch 2.7.0+cu126


def _a100(name: str, column: str, *, memory_gb: float, memory_bw: float) -> Profile:
    """The A100s share their rates (fp64 tensor 19.5, fp32 19.5, tf32 156, bf16 312 TF);
    an SXM4 node's 8 on NVLink, PCIe cards on PCIe (a 2-GPU NVLink bridge is optional)."""
    return _gpu(
        name,
        fp64=19.5e12,
        fp32=19.5e12,
        tf32=156e12,
        bf16=312e12,
        matmul_share=A100_SHARE,
        memory_gb=memory_gb,
        memory_bw=memory_bw,
        intra=_links(near=NVLINK_600, far=PCIE_GEN4, near_group=8 if "SXM" in column else 1),
        ib=IB_HDR,
        source=f"{A100}, {column}",
    )


# The H100 and H200 datasheets' columns: FP64 Tensor Core (each column's FP32 is the same
# figure), then the TF32 and BF16 Tensor Core figures with sparsity, FLOP/s
HOPPER = {
    "sxm": (67e12, 989e12, 1979e12),
    "nvl": (60e12, 835e12, 1671e12),
    "pcie": (51e12, 756e12, 1513e12),
}


def _hopper(name: str, column: str, **part) -> Profile:
    """An H100 or H200 of the datasheet's `column` (HOPPER); its tensor rates dense."""
    fp64, tf32_sparse, bf16_sparse = HOPPER[column]
    return _gpu(
        name,
        fp64=fp64,
        fp32=fp64,
        tf32=tf32_sparse / 2,
        bf16=bf16_sparse / 2,
        matmul_share=H100_SHARE,
        ib=IB_NDR,
        **part,
    )


PARTS = {
    p.name: p
    for p in (
        _a100("a100-sxm4-40gb", "A100 40GB SXM", memory_gb=40, memory_bw=1.555e12),
        _a100("a100-sxm4-80gb", "A100 80GB SXM", memory_gb=80, memory_bw=2.039e12),
        _a100("a100-pcie-40gb", "A100 40GB PCIe", memory_gb=40, memory_bw=1.555e12),
        _a100("a100-pcie-80gb", "A100 80GB PCIe", memory_gb=80, memory_bw=1.935e12),
        _hopper(
            "h100-sxm",
            "sxm",
            memory_gb=80,
            memory_bw=3.35e12,
            intra=_links(near=NVLINK_900, far=PCIE_GEN5, near_group=8),
            source=f"{H100_NVL}, H100 SXM",
        ),
        _hopper(
            "h100-pcie",
            "pcie",
            memory_gb=80,
            memory_bw=2.0e12,
            intra=_links(near=NVLINK_600, far=PCIE_GEN5, near_group=1),
            source=f"{H100_PCIE}, H100 PCIe",
        ),
        _hopper(
            "h100-nvl",
            "nvl",
            memory_gb=94,
            memory_bw=3.9e12,
            # sold in pairs on an NVLink bridge; the pairs meet over PCIe
            intra=_links(near=NVLINK_600, far=PCIE_GEN5, near_group=2),
            source=f"{H100_NVL}, H100 NVL",
        ),
        _hopper(
            "h200-sxm",
            "sxm",
            memory_gb=141,
            memory_bw=4.8e12,
            intra=_links(near=NVLINK_900, far=PCIE_GEN5, near_group=8),
            source=f"{H200}, H200 SXM",
        ),
        _hopper(
            "h200-nvl",
            "nvl",
            memory_gb=141,
            memory_bw=4.8e12,
            # a 2- or 4-way NVLink bridge: planned as the 2-way one
            intra=_links(near=NVLINK_900, far=PCIE_GEN5, near_group=2),
            source=f"{H200}, H200 NVL",
        ),
    )
}
# The names `--hardware` and SCALETRAIN_HARDWARE took before the parts were told apart:
# the SXM parts they described.
ALIASES = {"a100": "a100-sxm4-80gb", "h100": "h100-sxm", "h200": "h200-sxm"}
BUILTIN = {**PARTS, **{alias: PARTS[part] for alias, part in ALIASES.items()}}
# torch.cuda.get_device_name() of each part, matched whole: a name that merely contains
# another ("NVIDIA H100 NVL" contains "H100") is a different part with other rates
DEVICE_NAMES = {
    "NVIDIA A100-SXM4-40GB": "a100-sxm4-40gb",
    "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200-sxm",
    "NVIDIA H200 NVL": "h200-nvl",
}


class ProfileError(UserError):
    pass


def load_profile(name_or_path: str) -> Profile:
    """A built-in by name (a key of BUILTIN, any case) or a profile TOML's path."""
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
        profile = _read(Profile, {"source": str(path), **data})
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
    planner predicts with it is `factor` times as long. What scales how is each field's
    declared `scale` (`quantity`)."""
    return _scaled(profile, factor)


def _scaled(x, factor: float):
    """A Profile or Link with each field scaled as it declares."""
    changes: dict[str, Any] = {}
    for f in fields(x):
        value, scale = getattr(x, f.name), f.metadata.get("scale", "none")
        if scale == "rate":
            changes[f.name] = (
                {k: v / factor for k, v in value.items()}
                if isinstance(value, dict)
                else value / factor
            )
        elif scale == "time":
            changes[f.name] = value * factor
        elif scale == "links" and isinstance(value, dict):
            changes[f.name] = {k: _scaled(v, factor) for k, v in value.items()}
        elif scale == "links" and value is not None:
            changes[f.name] = _scaled(value, factor)
    return replace(x, **changes)


def _read(cls, data: dict[str, Any]):
    """A Profile or Link from its TOML table, each field converted to its declared type (an
    unknown key in a link is an error; a profile's unknown keys, another version's, are not
    read). Raises KeyError, TypeError or ValueError for a missing or wrong value."""
    hints = typing.get_type_hints(cls)
    if cls is Link and set(data) - set(hints):
        raise TypeError(f"unknown link keys {sorted(set(data) - set(hints))}")
    return cls(
        **{f.name: _typed(hints[f.name], data[f.name]) for f in fields(cls) if f.name in data}
    )


def _typed(kind, value: Any) -> Any:
    """`value` as the declared type `kind` (float, int, bool, str, the dicts and links)."""
    if kind in (float, int, str):
        return kind(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{value!r} is not true or false")
        return value
    if kind == dict[str, float]:
        return {str(k): float(v) for k, v in value.items()}
    if kind == dict[int, Link]:
        return {int(k): _read(Link, v) for k, v in value.items()}
    if kind == Link | None:
        return _read(Link, value)
    raise TypeError(f"no reader for {kind}")


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
    if profile is not None:
        total, where = profile.memory_bytes, f"{profile.name}'s memory"
    else:
        total, where = _mem_total(), "this machine's memory"
    return total // ranks_per_node, f"{where} over {ranks_per_node} rank(s)"


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def cpu_name() -> str:
    """This CPU's model name (/proc/cpuinfo), or "this CPU" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "this CPU"
