"""DDP vs DiLoCo vs streaming DiLoCo between two nodes joined by a real, slow link.

Two network namespaces on this machine are the two nodes, joined by a veth pair whose both
ends `tc` limits (netem: --rate Mbit/s and --delay ms each way; a kernel without netem gets
the rate alone, from tbf, and the header says so). Each contender runs one `scaletrain
train` per node (`ip netns exec NODE ... --nnodes 2 --rdzv-endpoint NODE0:PORT`): torchrun's
c10d rendezvous meets across the link, gloo's sockets sit on the veth (GLOO_SOCKET_IFNAME),
so a node's ranks reach the other node's only over the limited link. The contenders train
the same config, examples and steps, one after the other in this invocation:

- ddp: every step all-reduces the gradients over the link (parallel.dp_replicate = 2; with
  --nproc P > 1 each node shards over its P ranks, dp_shard = P, for every contender);
- diloco: each node is an island that takes --sync-every inner steps, then the islands
  all-reduce the pseudo-gradient and take the outer Nesterov step (parallel.strategy =
  "diloco");
- streaming: DiLoCo syncing --fragments fragments on a staggered schedule, the exchange
  overlapping --overlap-steps inner steps;
- streaming-Q: the same, the exchanged pseudo-gradients quantized to --quantize.

A contender whose config does not validate (a strategy this checkout lacks) is skipped with
the config's own message. Measured per contender: training time (summary.json's
`train_time_s`, rank 0: the loop, no start-up, no evaluation) and the whole command's wall
time; bytes sent over the link both ways (each veth's tx_bytes, read in its namespace before
and after: rendezvous, stores and evaluation included) and per step; the bytes per step
scaletrain logs (`comm_bytes_per_step`); the final eval loss (summary.json). Ratios are
against ddp.

The workload: GPT small on the byte-level Wikipedia excerpt (configs/gpt-wikitext.toml's
model, data and optimizer), 8 sequences of 128 tokens per node and step. What DiLoCo saves is
the link's share of a DDP step: the all-reduce moves about 4N bytes (N fp32 parameters) each
way, 32N / R seconds at R bit/s, against 6NT / F seconds of compute for T tokens at F
FLOP/s per node, a ratio of 32F / (6TR) that the parameter count leaves out. Between GPU
nodes on an ordinary network F is in the hundreds of TFLOP/s and the link dominates; one CPU
core per node needs a small T for the same regime, hence 8 x 128 tokens (BENCHMARKS.md
gives the measured split). --global-batch, --size and --rate move it.

The link and the nodes are bench/slow_link.py's (why each node has a host name of its own,
what is removed and when). Every namespace, veth and hosts file is removed on exit, Ctrl-C,
SIGTERM and errors included, and at the start, should an earlier run have been killed.

    PYTHONPATH=src .venv/bin/python bench/diloco.py           # GPT small, 300 steps (root)
    PYTHONPATH=src .venv/bin/python bench/diloco.py --quick   # GPT tiny, 20 steps, ~1-2 min
    ... --contenders ddp --rate 100 --delay 20                # DDP alone on 100 Mbit/s, 20 ms

Needs root, iproute2 (`ip`, `tc`), util-linux `unshare` and network namespaces; where one
is missing it prints one line naming it and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from slow_link import SRC, Link, LinkError, missing, node_command, node_env, probe, run_nodes

# --------------------------------------------------------------------------- the runs

CONFIG = """
name = "bench-diloco"
[model]
name = "gpt"
size = "{size}"
[data]
source = "{source}"
seq_len = {seq_len}
[optim]
lr = {lr}
warmup_steps = {warmup}
weight_decay = 0.1
betas = [0.9, 0.95]
[train]
steps = {steps}
global_batch = {global_batch}
micro_batch = {micro_batch}
eval_every = {steps}
eval_examples = {eval_examples}
threads = {threads}
seed = 0
[precision]
mode = "{precision}"
[log]
every = {log_every}
quiet = true
"""


def contenders(a: argparse.Namespace) -> dict[str, list[str]]:
    """Each contender's config overrides beyond the shared config and layout."""
    diloco = ["parallel.strategy=diloco", f"diloco.sync_every={a.sync_every}"]
    streaming = [
        *diloco,
        f"diloco.fragments={a.fragments}",
        f"diloco.overlap_steps={a.overlap_steps}",
    ]
    return {
        "ddp": [],
        "diloco": diloco,
        "streaming": streaming,
        f"streaming-{a.quantize}": [*streaming, f"diloco.quantize={a.quantize}"],
    }


def layout(nproc: int) -> list[str]:
    """Every contender's layout: one replica per node (the islands), sharded inside it."""
    return ["parallel.dp_replicate=2", f"parallel.dp_shard={nproc}"]


def invalid(config: Path, overrides: list[str]) -> str | None:
    """The config's own message when `overrides` do not validate; None when they do."""
    from scaletrain.config import load_config
    from scaletrain.errors import ConfigError

    try:
        load_config(config, overrides)
    except ConfigError as e:
        return str(e)
    return None


@dataclass
class Result:
    name: str
    train_s: float = 0.0
    wall_s: float = 0.0
    link_bytes: int = 0
    steps: int = 0
    logged_bytes_per_step: float = 0.0
    eval_loss: float = float("nan")
    foreign: float = 0.0
    error: str = ""  # why it has no numbers
    sent: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_step(self) -> float:
        return self.link_bytes / self.steps if self.steps else float("nan")


def train(
    name: str,
    overrides: list[str],
    *,
    a: argparse.Namespace,
    link: Link,
    config: Path,
    root: Path,
    port: int,
) -> Result:
    """One contender on both nodes; its numbers, or its error."""
    run_dir = root / name
    rdzv_id = f"bench-diloco-{name}-{os.getpid()}"
    endpoint = f"{link.nodes[0].addr}:{port}"
    args = [*layout(a.nproc), *overrides]
    cmds = [
        node_command(
            n,
            config=config,
            overrides=args,
            nproc=a.nproc,
            endpoint=endpoint,
            rdzv_id=rdzv_id,
            run_dir=run_dir,
        )
        for n in link.nodes
    ]
    logs = [root / f"{name}.{n.hostname}.log" for n in link.nodes]
    before = link.tx_bytes()
    started = time.perf_counter()
    codes = run_nodes(
        cmds, [node_env(n, dict(os.environ)) for n in link.nodes], logs, timeout=a.timeout
    )
    wall = time.perf_counter() - started
    after = link.tx_bytes()
    r = Result(name, wall_s=wall, sent={k: after[k] - before[k] for k in after})
    r.link_bytes = sum(r.sent.values())
    if codes != [0, 0] or not (run_dir / "summary.json").is_file():
        tail = logs[0].read_text()[-1500:] if logs[0].exists() else ""
        r.error = f"exit codes {codes}; node logs {logs[0]} and {logs[1]}; node 0's tail:\n{tail}"
        return r
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [rec for rec in records if rec["kind"] == "train"]
    r.train_s, r.steps = summary["train_time_s"], summary["steps"]
    r.eval_loss = summary["eval"]["loss"]
    # each record's window holds examples / global_batch steps
    sent = sum(
        rec.get("comm_bytes_per_step", 0.0) * rec["examples"] / a.global_batch for rec in trains
    )
    r.logged_bytes_per_step = sent / r.steps if r.steps else 0.0
    return r


# --------------------------------------------------------------------------- the table


def size(n: float) -> str:
    """Bytes as B, kB, MB or GB (powers of 1000, as link rates are counted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def ratio_rows(results: list[Result], *, reference: str = "ddp") -> list[list[str]]:
    """The table's rows: each contender's numbers and its ratios to `reference`'s."""
    ref = next((r for r in results if r.name == reference and not r.error), None)
    rows = []
    for r in results:
        if r.error:
            rows.append([r.name, "failed"] + [""] * 10)
            continue
        x = lambda mine, theirs: f"{mine / theirs:.3f}" if ref and theirs else "-"  # noqa: E731
        loss_pct = f"{100 * (r.eval_loss / ref.eval_loss - 1):+.2f}%" if ref else "-"
        rows.append(
            [
                r.name,
                f"{r.train_s:.1f}",
                x(r.train_s, ref.train_s if ref else 0),
                x(ref.train_s, r.train_s) if ref else "-",
                f"{r.wall_s:.1f}",
                size(r.link_bytes),
                x(r.link_bytes, ref.link_bytes if ref else 0),
                size(r.bytes_per_step),
                size(r.logged_bytes_per_step),
                f"{r.eval_loss:.4f}",
                loss_pct,
                f"{r.foreign:.2f}",
            ]
        )
    return rows


HEADER = [
    "contender",
    "train s",
    "x ddp",
    "speed-up",
    "wall s",
    "link bytes",
    "x ddp",
    "link B/step",
    "logged B/step",
    "eval loss",
    "vs ddp",
    "foreign",
]


def table(results: list[Result]) -> str:
    rows = [HEADER, *ratio_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )


def verdicts(results: list[Result], *, sync_every: int) -> list[str]:
    """The issue's goals for plain DiLoCo against ddp, each with its number."""
    by = {r.name: r for r in results if not r.error}
    if "ddp" not in by or "diloco" not in by:
        return []
    ddp, dl = by["ddp"], by["diloco"]
    time_x = dl.train_s / ddp.train_s
    # the exchange's own bytes (comm_bytes_per_step, as logged); the link's total also
    # carries the rendezvous, the metrics' and the evaluation's traffic
    bytes_x = dl.logged_bytes_per_step / ddp.logged_bytes_per_step
    link_x = dl.bytes_per_step / ddp.bytes_per_step
    loss_x = abs(dl.eval_loss / ddp.eval_loss - 1)
    mark = lambda ok: "ok" if ok else "NOT MET"  # noqa: E731
    return [
        f"diloco train time / ddp's: {time_x:.3f} (goal <= 0.4) {mark(time_x <= 0.4)}",
        f"diloco logged bytes per step / ddp's: 1/{1 / bytes_x:.2f} (goal <= 1/H = "
        f"1/{sync_every}; over the link, all traffic: 1/{1 / link_x:.2f}) "
        f"{mark(bytes_x <= 1 / sync_every)}",
        f"diloco eval loss vs ddp's: {100 * loss_x:.2f}% apart (goal within 3%) {mark(loss_x <= 0.03)}",
    ]


# --------------------------------------------------------------------------- main


# --quick: GPT tiny (2 layers of 64) on short sequences, a handful of outer steps.
QUICK = {
    "size": "tiny",
    "seq_len": 64,
    "steps": 20,
    "sync_every": 4,
    "warmup": 2,
    "global_batch": 16,
    "eval_examples": 32,
    "log_every": 5,
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--rate", type=float, default=100.0, help="link rate each way, Mbit/s")
    p.add_argument("--delay", type=float, default=20.0, help="added delay each way, ms (netem)")
    p.add_argument("--quick", action="store_true", help="GPT tiny, 20 steps, H 4: a smoke run")
    p.add_argument("--contenders", default="", help="comma-separated; default: all four")
    p.add_argument("--steps", type=int, default=300, help="train.steps (a multiple of H)")
    p.add_argument("--sync-every", type=int, default=50, help="diloco.sync_every, H")
    p.add_argument("--fragments", type=int, default=2, help="streaming: diloco.fragments")
    p.add_argument("--overlap-steps", type=int, default=1, help="streaming: diloco.overlap_steps")
    p.add_argument(
        "--quantize", default="int4", help="the last contender's diloco.quantize (int8, int4, ...)"
    )
    p.add_argument("--size", default="small", help="built-in GPT size (tiny, small, base)")
    p.add_argument("--source", default="wikitext", help="data.source (byte-level text)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, both nodes")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW (inner) peak LR, cosine")
    p.add_argument("--warmup", type=int, default=30, help="optim.warmup_steps")
    p.add_argument("--eval-examples", type=int, default=256, help="sequences of the final eval")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--nproc", type=int, default=1, help="processes per node (2 cores here: 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--port", type=int, default=29411, help="rendezvous port on node 0 (+1 each)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per contender")
    p.add_argument(
        "--retries", type=int, default=0, help="re-runs of a run disturbed by other processes"
    )
    p.add_argument("--keep", type=Path, help="keep the run directories and node logs here")
    if p.parse_known_args(argv)[0].quick:  # its sizes, under any flag given too
        p.set_defaults(**QUICK)
    a = p.parse_args(argv)
    if a.steps % a.sync_every:
        p.error(
            f"--steps ({a.steps}) must be a multiple of --sync-every ({a.sync_every}): "
            "the final eval then sees the islands' shared weights"
        )
    if a.steps % a.log_every:
        p.error(f"--steps ({a.steps}) must be a multiple of --log-every ({a.log_every})")
    return a


def runnable(a: argparse.Namespace, config: Path) -> dict[str, list[str]]:
    """The chosen contenders whose configs validate; a line for each that does not."""
    every = contenders(a)
    names = a.contenders.split(",") if a.contenders else list(every)
    unknown = set(names) - set(every)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; allowed: {', '.join(every)}")
    chosen = {}
    for name in names:
        why = invalid(config, [*layout(a.nproc), *every[name]])
        if why:
            print(f"skip {name}: its config does not validate in this checkout: {why}")
        else:
            chosen[name] = every[name]
    return chosen


def run_all(
    a: argparse.Namespace, chosen: dict[str, list[str]], *, config: Path, root: Path
) -> list[Result]:
    """Build the link, run each contender over it (once the machine is quiet), remove it."""
    from common import measured

    results = []
    with Link(rate_mbit=a.rate, delay_ms=a.delay) as link:
        rtt, mbit = probe(link, port=a.port - 1, nbytes=int(a.rate * 1e6 / 8))
        print(
            f"GPT {a.size} on {a.source}, {a.steps} steps of {a.global_batch} x {a.seq_len} "
            f"tokens, AdamW lr {a.lr:g} cosine, {a.precision}; 2 nodes x {a.nproc} process(es), "
            f"{a.threads} thread(s) each; H = {a.sync_every}, fragments {a.fragments}, "
            f"overlap {a.overlap_steps}, quantize {a.quantize}"
        )
        print(f"link: {link.describe()}; measured {mbit:.1f} Mbit/s, RTT {rtt:.2f} ms")
        if link.note:
            print(f"link: {link.note}")
        for i, (name, overrides) in enumerate(chosen.items()):
            one = functools.partial(
                train, name, overrides, a=a, link=link, config=config, root=root, port=a.port + i
            )
            r, foreign, note = measured(one, retries=a.retries)
            r.foreign = foreign
            results.append(r)
            if r.error:
                print(f"  {name} failed: {r.error}", flush=True)
                continue
            print(
                f"  ran {name}: train {r.train_s:.1f} s, wall {r.wall_s:.1f} s, "
                f"{size(r.link_bytes)} over the link, eval loss {r.eval_loss:.4f}, foreign load "
                f"{r.foreign:.2f} cores{note}",
                flush=True,
            )
    return results


def report(results: list[Result], *, sync_every: int) -> None:
    print()
    print(table(results))
    print(
        "train s: summary.json's train_time_s (rank 0's training loop); wall s: both nodes' "
        "commands, start-up included; link bytes: tx_bytes of both veth ends, both directions, "
        "rendezvous and evaluation included; logged B/step: scaletrain's comm_bytes_per_step "
        "(each rank's); foreign: cores busy outside this benchmark during the run"
    )
    for line in verdicts(results, sync_every=sync_every):
        print(line)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    reason = missing()
    if reason:
        print(f"bench/diloco.py: skipped: {reason}")
        return 0
    sys.path.insert(0, str(SRC))  # validate with the scaletrain the nodes run
    # SIGTERM and SIGHUP end the run as Ctrl-C does: the nodes stop, the link goes.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        config = root / "bench-diloco.toml"
        config.write_text(CONFIG.format(**vars(a)))
        chosen = runnable(a, config)
        if not chosen:
            return 0
        try:
            results = run_all(a, chosen, config=config, root=root)
        except LinkError as e:
            print(f"bench/diloco.py: skipped: could not build the link: {e}")
            return 0
        except KeyboardInterrupt as e:
            why = str(e) or "SIGINT"
            print(f"bench/diloco.py: interrupted ({why}): nodes stopped, link removed")
            return 130
        report(results, sync_every=a.sync_every)
    print(
        f"\nbenchmark wall time {time.perf_counter() - started:.0f} s; command: "
        f"{' '.join([Path(sys.executable).name, *sys.argv])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
