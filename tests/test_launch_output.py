"""What the launcher shows and keeps, without starting processes: the console filter, the
failure paragraph, the per-rank log names, the interrupt line, torchrun's flags, file modes,
and the SIGTERM flag of a single process."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from scaletrain.launch.agent import LaunchError, LaunchSpec, torchrun_argv
from scaletrain.launch.output import (
    OutputFilter,
    describe_child_failure,
    describe_interrupt,
    last_error_line,
    run_dir_logs,
)

# What rank 1 printed when rank 0 (the store's host) was killed: c10d's C++ warning glued
# onto the progress bar's line, its stack frames, then our own error line.
CPP_NOISE = (
    "\r  0%|          | 124/100000 [00:01<14:37, 113.86step/s, loss=0.0558]"
    "[rank1]:[W1201 09:28:02.499658610 TCPStore.cpp:106] [c10d] sendBytes failed on "
    "SocketImpl(fd=3): Broken pipe\n"
    "Exception raised from sendBytes at /__w/pytorch/torch/csrc/distributed/c10d/Utils.hpp:758 "
    "(most recent call first):\n"
    "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f2d31579b8d in libc10.so)\n"
    "frame #6: c10d::TCPStore::check(std::vector<std::string> const&) + 0x35d (0x7f2d in x.so)\n"
    "<omitting python frames>\n"
    "frame #32: _start + 0x21 (0x5630294dd081 in python)\n"
    "\n"
    "scaletrain: error: collective 'gradient all-reduce (DDP backward)' at step 131 could not "
    "complete: rank 0 (which hosts the rendezvous store) is unreachable.\n"
)

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/x/trainer.py", line 10, in train\n'
    "    loss.backward()\n"
    "RuntimeError: first\n"
    "\n"
    "During handling of the above exception, another exception occurred:\n"
    "\n"
    "Traceback (most recent call last):\n"
    '  File "/x/cli.py", line 3, in main\n'
    "KeyboardInterrupt\n"
)


def _shown(text: str, *, chunk: int = 7) -> str:
    """Feed the filter in small pieces, as a growing log file arrives."""
    f = OutputFilter()
    out = "".join(f.feed(text[i : i + chunk]) for i in range(0, len(text), chunk))
    return out + f.flush()


def test_filter_drops_cpp_frames_and_keeps_the_bar() -> None:
    shown = _shown(CPP_NOISE)
    for noise in (
        "TCPStore",
        "sendBytes",
        "frame #",
        "omitting",
        "Exception raised from",
        "scaletrain: error:",
    ):
        assert noise not in shown, shown
    assert "124/100000" in shown  # the bar's text before the glued C++ line survives
    assert shown.strip("\r\n ").endswith("loss=0.0558]"), repr(shown)


def test_filter_drops_chained_tracebacks_and_keeps_messages() -> None:
    text = (
        "# scaletrain worker: rank 0 of 2 (local rank 0), pid 1\n"
        "scaletrain: eval at step 10: loss 0.5\n"
        + TRACEBACK
        + "scaletrain: resumed from x at step 3\n"
        + "W1201 09:27:44.440000 4518 torch/distributed/api.py:1028] Sending process 4525\n"
    )
    shown = _shown(text)
    assert shown == "scaletrain: eval at step 10: loss 0.5\nscaletrain: resumed from x at step 3\n"


def test_filter_passes_every_bar_update_once_the_next_begins() -> None:
    f = OutputFilter()
    assert f.feed("\r 10%|#    | 1/10") == "\r"
    assert f.feed("\r 20%|##   | 2/10") == " 10%|#    | 1/10\r"
    assert f.feed("\n") == " 20%|##   | 2/10\n"


def _failure(pid: int, local_rank: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, local_rank=local_rank, exitcode=exitcode)


def test_failure_paragraph_names_the_cause_first_and_quotes_the_error(tmp_path: Path) -> None:
    logs = {r: tmp_path / f"rank-{r}.log" for r in (0, 1, 2)}
    logs[0].write_text("# header\n" + TRACEBACK.replace("KeyboardInterrupt", "ValueError: bad row"))
    logs[1].write_text(CPP_NOISE)
    logs[2].write_text("")
    # The agent lists the ranks it stopped (SIGTERM) after the one that failed.
    error = SimpleNamespace(
        failures={
            2: _failure(12, 0, -signal.SIGKILL),
            1: _failure(11, 1, 1),
            0: _failure(10, 0, -signal.SIGTERM),
        }
    )

    text = describe_child_failure(error, logs=logs)

    assert text.startswith(
        "scaletrain: error: the run failed: rank 1 (pid 11, local rank 1) "
        "exited with code 1: collective 'gradient all-reduce"
    ), text
    assert "rank 2 (pid 12, local rank 0) was killed by SIGKILL" in text
    assert "rank 0 (pid 10, local rank 0) was stopped by the launcher after rank 2 failed" in text
    for r in (0, 1, 2):
        assert f"its output is in {logs[r]}" in text
    assert "\n" not in text  # one paragraph
    assert last_error_line(logs[0]) == "ValueError: bad row"
    assert last_error_line(logs[2]) is None


def test_each_rank_gets_its_own_log_and_none_is_overwritten(tmp_path: Path) -> None:
    seen = []
    logs = run_dir_logs(tmp_path / "logs", on_attempt=seen.append)

    def reify(restart: str):
        envs = {lr: {"RANK": str(4 + lr), "TORCHELASTIC_RESTART_COUNT": restart} for lr in (0, 1)}
        dest = logs.reify(envs)
        for path in dest.stderrs.values():
            Path(path).write_text("x")
        return dest, envs

    dest, envs = reify("0")  # node 1 of 2: global ranks 4 and 5
    assert dest.stderrs == {
        0: str(tmp_path / "logs/rank-4.log"),
        1: str(tmp_path / "logs/rank-5.log"),
    }
    assert dest.stdouts == {0: "", 1: ""}  # stdout joins stderr inside the worker
    assert envs[0]["TORCHELASTIC_ERROR_FILE"].endswith("rank-4.error.json")
    assert seen == [tmp_path / "logs/rank-4.log"]
    assert logs.paths == {4: tmp_path / "logs/rank-4.log", 5: tmp_path / "logs/rank-5.log"}
    assert reify("1")[0].stderrs[0] == str(tmp_path / "logs/rank-4.restart-1.log")
    assert reify("0")[0].stderrs[1] == str(tmp_path / "logs/rank-5.2.log")  # a later launch
    assert not dest.tee_stderrs


def test_interrupt_line_names_step_checkpoint_and_how_to_continue(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 41}\n{"kind": "eval", "step": 40}\n{"kind": "tr'
    )
    assert describe_interrupt(tmp_path, signum=signal.SIGINT) == (
        "scaletrain: interrupted (SIGINT) at step 41; no checkpoint to continue from "
        "(checkpoint.every = 0, or none was reached); set checkpoint.every to make a run "
        "resumable"
    )
    (tmp_path / "checkpoints/step-00000043").mkdir(parents=True)
    (tmp_path / "checkpoints/.tmp-step-00000050").mkdir()
    assert describe_interrupt(tmp_path, signum=signal.SIGTERM) == (
        f"scaletrain: interrupted (SIGTERM) at step 43; last checkpoint step-00000043; "
        f"continue with: scaletrain train ... --run-dir {tmp_path} --resume"
    )


def test_torchrun_flags_keep_logs_and_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCALETRAIN_SIGTERM_GRACE_S", raising=False)
    argv = torchrun_argv(LaunchSpec(nproc=2), ["train", "c.toml"], log_dir=tmp_path)
    assert f"--log-dir={tmp_path}" in argv and "--redirects=2" in argv and "--tee=0" in argv
    assert "--shutdown-timeout=30" in argv
    monkeypatch.setenv("SCALETRAIN_SIGTERM_GRACE_S", "90")
    argv = torchrun_argv(LaunchSpec(nproc=2), ["train"], log_dir=tmp_path, debug=True)
    assert "--tee=2" in argv and "--shutdown-timeout=90" in argv
    monkeypatch.setenv("SCALETRAIN_SIGTERM_GRACE_S", "soon")
    with pytest.raises(LaunchError, match="SCALETRAIN_SIGTERM_GRACE_S = 'soon' is invalid"):
        torchrun_argv(LaunchSpec(nproc=2), ["train"])


def test_output_files_get_the_umask_mode(tmp_path: Path) -> None:
    from scaletrain.runtime import honour_umask

    path = tmp_path / "w.safetensors"
    path.write_bytes(b"x")
    path.chmod(0o600)
    old = os.umask(0o027)
    try:
        honour_umask(path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


def test_sigterm_sets_a_flag_with_checkpointing_and_stops_at_once_without() -> None:
    from scaletrain.training import signals

    before = signal.getsignal(signal.SIGTERM)
    with signals.installed(save_on_term=True):
        assert not signals.stop_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop_requested()
        with pytest.raises(signals.Terminated):  # a second SIGTERM does not wait
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    with signals.installed(save_on_term=False):
        assert not signals.stop_requested()
        with pytest.raises(signals.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
