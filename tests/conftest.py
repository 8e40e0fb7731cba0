"""Session-wide fixtures shared by the test files.

`trained`: trainings run through `harness.run_job` in the session's pool of ranks for their
world size (started on first use, one process group each, job after job in it, stopped at
the session's end), cached for the whole session by what they are (world size, config text,
overrides, working directory). A file asking for a run another file already made gets the
same run directory back: the single-process references of the dp, accumulation and
model-parallel parity files are computed once per session. Cached run directories are
shared: a test reads them and never writes into them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from harness import Case, CaseResult, run_job, stop_pools


class Trained:
    """`trained(cases, world_size=N)` -> {name: CaseResult}; runs only what is not cached."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, CaseResult] = {}
        self.jobs = 0

    @staticmethod
    def key(case: Case, *, world_size: int, cwd: Path | None) -> str:
        text = json.dumps(
            [world_size, case.config, case.legs, case.expect_ok, str(cwd) if cwd else None]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def __call__(
        self,
        cases: dict[str, Case],
        *,
        world_size: int,
        cwd: Path | None = None,
        timeout: float = 300.0,
    ) -> dict[str, CaseResult]:
        keys = {
            name: self.key(case, world_size=world_size, cwd=cwd) for name, case in cases.items()
        }
        missing: dict[str, Case] = {}
        for name, case in cases.items():  # the same run asked for twice runs once
            if keys[name] not in self.done and keys[name] not in {k[-12:] for k in missing}:
                missing[f"{name}-{keys[name]}"] = case
        if missing:
            self.jobs += 1
            got = run_job(
                missing,
                world_size=world_size,
                timeout=timeout,
                cwd=cwd,
                root=self.root / f"job{self.jobs}-w{world_size}",
                keep=True,  # one pool of ranks per world size for the whole session
            )
            for run_name, result in got.items():
                self.done[run_name[-12:]] = result
        return {name: self.done[key] for name, key in keys.items()}


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return Trained(tmp_path_factory.mktemp("trained"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_pools()  # the kept pools of ranks (run_job(keep=True), `trained` among them)


# A test that uses `trained` may be the one that pays for its module's jobs (each has its
# own timeout in run_job, and every rank is killed with it); pytest-timeout's per-test
# limit from pyproject.toml would count them all against one test.
TRAINED_TIMEOUT_S = 1200


# Seconds a file takes (its jobs included), as measured in a serial run on 2 cores; a file
# not named counts as light. Only the order the files are dealt out in depends on them.
FILE_SECONDS = {
    "test_model_parallel_parity.py": 170,
    "test_ps_resume.py": 85,
    "test_resume.py": 75,
    "test_ps_faults.py": 75,
    "test_e2e.py": 50,
    "test_spark.py": 55,
    "test_ps_parity.py": 50,
    "test_meta_init.py": 50,
    "test_launch_signals.py": 45,
    "test_ps_mnist.py": 40,
    "test_ps_staleness.py": 35,
    "test_ps_config.py": 20,
    "test_api.py": 30,
    "test_layout_resume.py": 25,
    "test_hang_report.py": 40,
    "test_profiling.py": 15,
    "test_accumulation.py": 20,
    "test_fsdp_memory.py": 15,
    "test_user_model_parity.py": 20,
    "test_distill_cache.py": 20,
    "test_dp_parity.py": 20,
    "test_compile.py": 20,
    "test_pipeline.py": 10,
    "test_distill_terms_parity.py": 35,
    "test_ps_threads.py": 45,
    "test_optim_parity.py": 120,
    "test_diloco_parity.py": 60,
}


def deal_files(files: list[str], *, workers: int) -> list[str]:
    """The files in the order that balances xdist's loadfile workers: it gives each worker
    its first max(files // 4 // workers, 2) files in collection order, then one file at a
    time to whichever runs short. The heaviest files are dealt round-robin into those
    first batches (worker i: the i-th, (i + workers)-th, ... heaviest), the rest follow
    heaviest first, so no worker starts with all the long files or ends with one alone."""
    ranked = sorted(files, key=lambda f: -FILE_SECONDS.get(Path(f).name, 1))
    first = max(len(files) // 4 // workers, 2) * workers
    batches = [ranked[:first][i::workers] for i in range(workers)]
    return [f for batch in batches for f in batch] + ranked[first:]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        files = list(dict.fromkeys(str(item.path) for item in items))
        place = {f: i for i, f in enumerate(deal_files(files, workers=workers))}
        items.sort(key=lambda item: place[str(item.path)])  # stable: in-file order kept
    for item in items:
        if (
            "trained" in getattr(item, "fixturenames", ())
            and item.get_closest_marker("timeout") is None
        ):
            item.add_marker(pytest.mark.timeout(TRAINED_TIMEOUT_S))
