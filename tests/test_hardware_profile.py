"""Hardware profiles declared once (runtime/hardware.py `quantity`): every field of `Profile`
and `Link` says its unit and how it is set, and loading and writing a profile follow those
declarations, for every field; a profile an older version wrote still loads."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from scaletrain.runtime.hardware import Link, Profile, load_profile, profile_toml


def _every_field_set() -> Profile:
    """A profile in which no field holds its default."""
    link = Link(
        bus_bw=1e9,
        latency_s=2e-4,
        fsdp_call_s=1e-3,
        tp_call_s=2e-3,
        fsdp_pair_call_s=3e-3,
        tp_pair_call_s=4e-3,
        fsdp_pair_step_s=5e-3,
        tp_pair_step_s=6e-3,
        fsdp_rss=7 * 2**20,
    )
    return Profile(
        name="m",
        flops={"fp32": 1e11, "bf16": 4e11},
        memory_bytes=2**34,
        memory_bw=1e10,
        intra={2: link, 4: Link(bus_bw=5e8, latency_s=3e-4)},
        inter=Link(bus_bw=2e8, latency_s=1e-3, tp_call_s=1e-2),
        devices_per_node=4,
        overlap=True,
        cores=2,
        op_s=6e-6,
        byte_s=3e-10,
        rss_ratio=1.4,
        fsdp_step_s=0.01,
        tp_step_s=0.02,
        matmul_efficiency=0.8,
        foreign_cores=0.4,
        steal_cores=0.1,
        source="a test",
    )


@pytest.mark.parametrize("cls", [Profile, Link])
def test_every_field_declares_its_unit_and_how_it_is_set(cls) -> None:
    """Each field's line, or the comment lines right above it, says its unit and how it is
    measured or set: a comment of a few words at least."""
    lines = inspect.getsource(cls).splitlines()
    for f in fields(cls):
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
        said = lines[at].partition("#")[2]
        above = at - 1
        while lines[above].strip().startswith("#"):
            said = lines[above].strip().lstrip("# ") + " " + said
            above -= 1
        assert len(said.split()) >= 3, f"{cls.__name__}.{f.name} says not its unit and how"


def test_a_profile_with_every_field_set_round_trips(tmp_path: Path) -> None:
    profile = _every_field_set()
    defaults = Profile(name="", flops={}, memory_bytes=0, memory_bw=0.0)
    unset = [
        f.name for f in fields(Profile) if getattr(profile, f.name) == getattr(defaults, f.name)
    ]
    assert unset == [], unset
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(profile))
    loaded = load_profile(str(path))
    assert loaded == profile
    assert type(loaded.intra[2].fsdp_rss) is int and type(loaded.memory_bw) is float


def test_a_profile_with_retired_keys_still_loads(tmp_path: Path) -> None:
    """rss_fixed (always 0), reference_round_s (calibrate's paces) and calibrated_on (the
    model a profile was refined on) are no longer fields; a profile written before still
    loads, the keys skipped."""
    profile = _every_field_set()
    path = tmp_path / "p.toml"
    old = 'rss_fixed = 0.0\nreference_round_s = 1.5\ncalibrated_on = "gpt size=tiny"\n'
    path.write_text(old + profile_toml(profile))
    assert load_profile(str(path)) == profile


def test_a_link_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    from scaletrain.runtime.hardware import ProfileError

    text = profile_toml(_every_field_set()).replace(
        "bus_bw = 1000000000.0", "bus_bw = 1e9\nspeed = 3", 1
    )
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match="missing or wrong key"):
        load_profile(str(path))
