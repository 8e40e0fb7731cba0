"""Hardware profiles: what a device computes and moves per second, for the planner and every
run's MFU (model FLOPs over the compute dtype's peak: on a CPU what `scaletrain calibrate`
measured, on a GPU the part's dense datasheet figure in parts.toml, as torchtitan's). A run's
profile: `SCALETRAIN_HARDWARE` (a built-in name or a path), else the CUDA device's part, else
on a CPU this machine's calibrated one (CALIBRATED), else none (MFU is logged as null)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from scaletrain.errors import UserError

CALIBRATED = Path.home() / ".cache" / "scaletrain" / "hardware.toml"


@dataclass(frozen=True)
class Link:
    """A collective's cost: latency_s + bytes on the wire / bus_bw. Each field: its unit, then
    how calibrate measures it or a GPU part sets it."""

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
    """A device's rates and the costs planner/reference.py fits. Each field: its unit, then
    how calibrate measures it or a GPU part sets it."""

    name: str  # "this-machine" (calibrate) or the built-in part's name
    flops: dict[str, float]  # FLOP/s by dtype: a device's, or one CPU core's matmuls, timed
    memory_bytes: int  # bytes a device: MemTotal, or the GPU's memory
    memory_bw: float  # bytes/s a device streams: a 128 MiB copy, timed
    intra: dict[int, Link] = field(default_factory=dict)  # world size (or the one below) -> Link
    inter: Link | None = None  # between nodes: a device's share of the node's NICs
    devices_per_node: int = 1  # devices: a GPU node's
    overlap: bool = False  # collectives overlap compute (GPU streams; gloo: no)
    cores: int = 0  # cores this process may use (sched_getaffinity); 0: a GPU profile
    op_s: float = 0.0  # s a forward op: dispatch and autograd of it and its backward, fitted
    byte_s: float = 0.0  # s a byte a forward writes, fitted with op_s; a GPU: 6 bytes of traffic
    rss_ratio: float = 1.0  # resident bytes per live tensor byte (CPU): DDP's, settled
    fsdp_step_s: float = 0.0  # s a step: FSDP2's cost once a step beyond its calls, 2 ranks
    tp_step_s: float = 0.0  # s a step: the same for DTensor
    # share of `flops` a matmul reaches (MFU stays against flops): a GPU's achievable/peak
    matmul_efficiency: Annotated[float, Field(gt=0, le=1)] = 1.0
    foreign_cores: float = 0.0  # cores: the most foreign load calibrate saw (runtime/load.py)
    steal_cores: float = 0.0  # cores: the same for steal (another VM's time on this host)
    source: str = ""  # where the figures come from

    def link(self, group_size: int, *, spans_nodes: bool = False) -> Link:
        if spans_nodes and self.inter is not None:
            return self.inter
        return self.intra[max(s for s in self.intra if s <= max(group_size, min(self.intra)))]

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


def _parts() -> tuple[dict[str, Profile], dict[str, str], dict[str, str]]:
    """The built-in GPU profiles by name (parts.toml: each figure's source beside it), the part
    of each CUDA device name, and the old names' parts."""
    table = tomllib.loads(resources.files(__package__).joinpath("parts.toml").read_text())
    links, latency = table["links"], table["latency"]
    parts = {}
    for name, row in table["parts"].items():
        a100 = row["rates"] == "a100"
        pcie = links["pcie4" if a100 else "pcie5"]
        near = pcie if row["node"] == "pcie" else links[row["nvlink"]]
        intra = {2: Link(near, latency["pair"]), 8: Link(near, latency["node"])}
        if row["node"] == "pairs":  # NVLink-bridged pairs: a larger group meets over PCIe
            intra = {2: Link(near, latency["pair"]), 3: Link(pcie, latency["node"])}
        rates = table["rates"][row["rates"]]
        achieved = table["achieved"]["a100" if a100 else "hopper"]
        parts[name] = Profile(
            name=name, flops={**rates, "fp16": rates["bf16"]}, memory_bw=row["memory_bw"],
            memory_bytes=int(row["memory_gb"] * 2**30), devices_per_node=8, overlap=True,
            intra=intra, inter=Link(links["hdr" if a100 else "ndr"], latency["nodes"]),
            byte_s=6 / row["memory_bw"],  # written, then read and written again by the backward
            matmul_efficiency=achieved["bf16"] / achieved["peak"],
            source=f"{table['sheets'][row['sheet']]}, {row['column']}",
        )  # fmt: skip
    devices = {row["device"]: name for name, row in table["parts"].items()}
    return parts, devices, table["aliases"]


PARTS, DEVICE_NAMES, ALIASES = _parts()
BUILTIN = {**PARTS, **{alias: PARTS[part] for alias, part in ALIASES.items()}}


class ProfileError(UserError):
    pass


def load_profile(name_or_path: str) -> Profile:
    """A built-in by name (any case) or a profile TOML's path; its unknown keys (another
    version's) are skipped, a link's are an error."""
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
        return TypeAdapter(Profile).validate_python(data)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"hardware profile {path} is not valid TOML ({e})") from None
    except ValidationError as e:
        wrong = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ProfileError(
            f"hardware profile {path}: missing or wrong key ({wrong}); a profile another "
            "version of `scaletrain calibrate` wrote: run it again"
        ) from None


def profile_toml(profile: Profile) -> str:
    import tomli_w

    # JSON mode: intra's sizes as the strings TOML's keys are; no inter, no table
    return tomli_w.dumps(TypeAdapter(Profile).dump_python(profile, mode="json", exclude_none=True))


def default_profile(device_type: str | None = None) -> Profile | None:
    """This run's profile (module docstring), or None where none is known; `device_type`
    "cuda" or "cpu", by default this machine's (a GPU machine plans its part)."""
    if device_type is None:
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if chosen := os.environ.get("SCALETRAIN_HARDWARE"):
        return load_profile(chosen)
    if device_type == "cuda":
        return device_profile()
    return load_profile(str(CALIBRATED)) if CALIBRATED.is_file() else None


def device_profile(index: int | None = None) -> Profile | None:
    """The built-in of CUDA device `index`'s exact part (default: the current one) with the
    device's memory; None for a part not in DEVICE_NAMES."""
    import torch

    index = torch.cuda.current_device() if index is None else index
    part = DEVICE_NAMES.get(torch.cuda.get_device_name(index).strip())
    if part is None:
        return None
    profile = PARTS[part]
    memory = torch.cuda.get_device_properties(index).total_memory
    return replace(profile, memory_bytes=memory, source=f"{profile.source}; memory: the device's")


def rank_budget(profile: Profile | None, *, ranks_per_node: int) -> tuple[int, str]:
    """Bytes one rank may use, and whence: a GPU's memory; a CPU's (the profile's, else this
    machine's) over the ranks it runs."""
    if profile is not None and not profile.cores:
        return profile.memory_bytes, f"{profile.name}'s memory"
    total = profile.memory_bytes if profile else total_memory()
    where = f"{profile.name}'s memory" if profile else "this machine's memory"
    return total // ranks_per_node, f"{where} over {ranks_per_node} rank(s)"


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # bytes: MemTotal


def cpu_name() -> str:
    """This CPU's model name (/proc/cpuinfo), or "this CPU" where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(
            line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return "this CPU"
