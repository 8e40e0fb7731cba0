"""A worker's failures keep their real cause: a store that fails in another way is not called
"rank 0 unreachable", a failed collective chains the backend's error, and a failed
destroy_process_group after a clean run is said, not swallowed. No process group needed."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import scaletrain.runtime as runtime


class _Store:
    def __init__(self, error: Exception | None = None, present: set[str] = frozenset()) -> None:
        self.error, self.keys = error, set(present)

    def set(self, key: str, value: str) -> None:
        if self.error is not None:
            raise self.error
        self.keys.add(key)

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch):
    """Rank 0 of a world of 2, as far as missing_ranks can tell; returns a store setter."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def use(store: _Store) -> None:
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)

    return use


def test_missing_ranks_tells_unreachable_from_other_store_failures(two_ranks) -> None:
    two_ranks(_Store(present={"failed/t/1"}))
    assert runtime.missing_ranks(tag="t", wait_s=0.2) == []
    two_ranks(_Store())
    assert runtime.missing_ranks(tag="t", wait_s=0.2) == [1]
    two_ranks(_Store(dist.DistNetworkError("Connection reset by peer")))
    assert runtime.missing_ranks(tag="t") is None  # the store's host is gone
    two_ranks(_Store(dist.DistStoreError("wait timeout after 300000ms")))
    with pytest.raises(dist.DistStoreError):
        runtime.missing_ranks(tag="t")
    two_ranks(_Store(KeyError("a bug")))
    with pytest.raises(KeyError):  # a bug is not a missing rank
        runtime.missing_ranks(tag="t")


def test_failure_message_names_the_store_failure_it_saw(two_ranks) -> None:
    two_ranks(_Store(dist.DistStoreError("wait timeout after 300000ms")))
    text = runtime.describe_collective_failure(
        RuntimeError("Gloo read error"), operation="metrics all-reduce", step=7
    )
    assert "rank 0" not in text and "unreachable" not in text, text
    assert "DistStoreError: wait timeout after 300000ms" in text and "Gloo read error" in text
    two_ranks(_Store(dist.DistNetworkError("Broken pipe")))
    assert (
        "rank 0 (which hosts the rendezvous store) is unreachable"
        in runtime.describe_collective_failure(RuntimeError("Gloo"), operation="x", step=1)
    )


def test_collective_failure_keeps_the_backend_error_as_its_cause(two_ranks) -> None:
    two_ranks(_Store())
    backend = RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection closed by peer")
    with pytest.raises(runtime.CollectiveFailure) as caught:
        with runtime.collective_guard("gradient all-reduce", step=3):
            raise backend
    assert caught.value.__cause__ is backend
    assert "rank(s) 1 did not arrive" in str(caught.value)
    with pytest.raises(ValueError):  # not a collective's error: passes through unchanged
        with runtime.collective_guard("x", step=0):
            raise ValueError("shape mismatch")


@pytest.mark.parametrize("code, said", [(0, True), (1, False)])
def test_exit_worker_says_when_destroy_fails_after_a_clean_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], code: int, said: bool
) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)

    def destroy() -> None:
        raise RuntimeError("Connection closed by peer")

    def leave(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    monkeypatch.setattr(runtime.os, "_exit", leave)
    with pytest.raises(SystemExit) as left:
        runtime.exit_worker(code)
    assert left.value.code == code
    err = capsys.readouterr().err
    assert (
        "destroy_process_group failed after a clean run: Connection closed by peer" in err
    ) == said


@pytest.mark.parametrize("mistake", [False, True], ids=["our-bug", "user-mistake"])
def test_worker_tells_our_bugs_from_user_mistakes(
    mistake: bool, monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rank's real error path (commands/worker.run_worker over trainer.train, world size 1): a
    ValueError from our code inside the build is a traceback and status 1; a user mistake
    raised at the same place is one `scaletrain: error:` paragraph and status 2."""
    import scaletrain.commands.worker as worker
    import scaletrain.training.build as build
    from scaletrain.config import validate_config
    from scaletrain.parallel.tensor import TensorParallelError

    def check(*args, **kwargs):
        if mistake:
            raise TensorParallelError("parallel.tp = 2: 'fc1' has 7 features")
        raise ValueError("an internal bug of scaletrain's")

    def leave(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr(build, "check_model_fits", check)
    monkeypatch.setattr(runtime, "exit_worker", leave)
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = validate_config(
        {
            "model": {"name": "mlp"},
            "data": {"source": "digits"},
            "train": {"steps": 1, "global_batch": 4, "micro_batch": 4},
        }
    )

    with pytest.raises(SystemExit) as left:
        worker.run_worker(config, tmp_path / "run", exit_process=True)

    err = capsys.readouterr().err
    if mistake:
        assert left.value.code == 2 and "Traceback" not in err, err
        assert "scaletrain: error: parallel.tp = 2: 'fc1' has 7 features" in err
    else:
        assert left.value.code == 1, err
        assert "Traceback" in err and "ValueError: an internal bug" in err, err
        assert "scaletrain: error" not in err
