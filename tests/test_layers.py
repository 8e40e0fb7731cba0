"""The house's floors: which room may import which, read from the source with `ast`.

Every `import` and `from ... import` in every module under src/scaletrain counts, at module
level or inside a function, a method or an `if TYPE_CHECKING:` block: an import inside a
function hides a cycle from Python, not from a reader. A room is a top-level module or
package of scaletrain (`data`, `parallel`, `config`, ...); `LAYERS` below is the one table
of allowed directions, bottom floor first. A module may import its own room and the rooms on
floors below its own, nothing on its own floor or above. On top of the room order, no two
modules may import each other through any chain (no module-level cycle inside a room either).

A new module or package needs a line in LAYERS (the test says so): choosing its floor is
choosing what it may depend on. docs/ARCHITECTURE.md ("Layers") shows the same order.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "scaletrain"

# Bottom floor first. Rooms on one floor do not import each other.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (name, frozenset(rooms))
    for name, rooms in (
        # leaves: the user-mistake errors below the user's code, and the process's runtime
        # (process group, heap policy, hardware facts, the measured attention kernel)
        ("errors", {"errors", "version"}),  # the user-mistake base classes: import nothing
        ("leaves", {"user_code", "runtime"}),
        ("data", {"data"}),  # sources, shards, sampler: know nothing of models
        ("models", {"models"}),  # built-in models and the ModelSpec protocol; take a TaskSpec
        # the techniques and the loss protocol: each takes plain values, owns its checks
        ("techniques", {"parallel", "precision", "loss"}),
        ("schema", {"config"}),  # the typed [sections], loading, overrides: no checks of others
        # what a run records and saves: metrics, report, memory; checkpoint state and files
        ("records", {"records", "checkpoint"}),
        ("distill", {"distill"}),  # teacher, student, objective, its cache and its checks
        # the run's life around its workers: resolve (config + world -> Derived, calling every
        # room's checks once), the run directory, the elastic agent and its console output
        ("launch", {"launch"}),
        ("training", {"training"}),  # builds from the config and runs the loop
        ("ps", {"ps"}),  # the parameter-server strategy reuses training's pieces
        ("planner", {"planner"}),  # every layout's memory and time, from the layout's own code
        # one module per subcommand, the Python API, the pre-launch checks, a rank's entry
        ("commands", {"commands"}),
        ("cli", {"cli"}),  # the parser and the dispatch to commands/
        ("command", {"console"}),  # the `scaletrain` command: the CLI behind a Ctrl-C guard
        ("entry", {"__main__", PACKAGE}),  # `python -m scaletrain`; the package's lazy exports
    )
)
FLOOR = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _target(module: str, name: str | None) -> str:
    """The scaletrain module an import names: `from scaletrain.x import y` is module
    scaletrain.x.y when that is a module, else scaletrain.x."""
    if name and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module


def imports_of(module: str, source: str, *, is_package: bool = False) -> set[str]:
    """Every scaletrain module `module` imports, wherever in its source the import sits."""
    found = set()
    for node in ast.walk(ast.parse(source, filename=module)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] == PACKAGE:
                found |= {_target(base, a.name) for a in node.names}
    found.discard(module)
    return found


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


@functools.cache
def edges() -> dict[str, set[str]]:
    """Module -> the scaletrain modules it imports (read once per session)."""
    return {
        m: imports_of(m, p.read_text(), is_package=p.name == "__init__.py")
        for m, p in MODULES.items()
    }


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports into the importer's own floor or above, but its own room: 'a -> b' lines."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ra, rb = room_of(a), room_of(b)
            if ra != rb and FLOOR[rb] >= FLOOR[ra]:
                bad.append(f"{a} ({LAYERS[FLOOR[ra]][0]}) -> {b} ({LAYERS[FLOOR[rb]][0]})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_floor():
    unplaced = sorted({room_of(m) for m in MODULES} - set(FLOOR))
    assert not unplaced, (
        f"rooms without a floor in tests/test_layers.py LAYERS: {unplaced}; "
        "add each where what it imports sits below it"
    )


def test_imports_go_down_only():
    bad = upward_imports(edges())
    assert not bad, "imports that go up or sideways:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    found = cycles(edges())
    assert not found, "import cycles (function-level imports count):\n  " + "\n  ".join(
        " <-> ".join(c) for c in found
    )


def test_techniques_import_nothing_from_above():
    """The issue's own words: models, data, parallel, precision import nothing from config,
    training, distill, ps, cli, api (a redundant, readable check of the table)."""
    above = {"config", "training", "distill", "ps", "cli", "api", "plan", "prelaunch"}
    graph = edges()
    bad = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if room_of(a) in {"models", "data", "parallel", "precision"} and room_of(b) in above
    ]
    assert not bad, "\n".join(sorted(bad))


def test_the_table_reads_what_it_means():
    """The scanner itself: relative and function-level imports are found, a module named
    by `from package import module` counts as that module, and an upward import is caught."""
    source = (
        "from __future__ import annotations\n"
        "from . import sources\n"
        "def f():\n"
        "    from scaletrain.cli import main\n"
        "    import scaletrain.training.trainer\n"
    )
    tree_imports = imports_of("scaletrain.data._probe", source)
    assert tree_imports == {
        "scaletrain.data.sources",
        "scaletrain.cli",
        "scaletrain.training.trainer",
    }
    graph = {"scaletrain.data._probe": tree_imports, **{m: set() for m in tree_imports}}
    assert upward_imports(graph) == [
        "scaletrain.data._probe (data) -> scaletrain.cli (cli)",
        "scaletrain.data._probe (data) -> scaletrain.training.trainer (training)",
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_floor_names_real_rooms():
    """A room in the table that no module has is a stale line."""
    stale = sorted(set(FLOOR) - {room_of(m) for m in MODULES})
    assert not stale, f"rooms in LAYERS that no module has: {stale}"


def test_a_room_checks_plain_values_without_the_config():
    """The parallel room's checks take the values plan.resolve hands down, not a Config:
    callable (and refusing, naming the key) with no schema in sight."""
    from scaletrain.errors import ConfigError
    from scaletrain.parallel.checks import check_collective, pipeline_shape, ps_layout
    from scaletrain.parallel.layout import LayoutError, ParallelLayout, layout_of

    with pytest.raises(LayoutError, match=r"parallel\.dp ="):  # the key the user wrote
        layout_of(dp=3, dp_replicate=-1, dp_shard=1, tp=1, pp=1, world_size=2)
    assert layout_of(dp=-1, dp_replicate=-1, dp_shard=1, tp=2, pp=1, world_size=4).dp_shard == 2
    layout = ParallelLayout(pp=2).resolve(2)
    shape = pipeline_shape(
        layout,
        schedule="interleaved-1f1b",
        microbatches=0,
        stages_per_rank=0,
        micro_batch=8,
        n_blocks=4,
    )
    assert (shape.microbatches, shape.stages_per_rank) == (4, 2)  # the defaults filled in
    with pytest.raises(ConfigError, match="train.micro_batch = 6"):
        pipeline_shape(
            layout, schedule="1f1b", microbatches=4, stages_per_rank=1, micro_batch=6, n_blocks=None
        )
    with pytest.raises(ConfigError, match="comm_hook"):
        check_collective(
            ParallelLayout(dp_shard=2).resolve(2),
            comm_hook="fp16",
            compile=False,
            precision="fp32",
            optim_impl="auto",
            sequence_parallel=True,
            seq_len=None,
        )
    _, roles = ps_layout(
        servers=1,
        world_size=3,
        dp=-1,
        dp_replicate=-1,
        degrees={"dp_shard": 1, "tp": 1, "pp": 1},
        comm_hook="none",
        compile=False,
        precision="fp32",
        lease_s=10.0,
        timeout_s=300.0,
    )
    assert (roles.workers, roles.role(0), roles.role(2)) == (2, ("server", 0), ("worker", 1))


def _print_graph() -> None:  # pragma: no cover - a reader's aid: python tests/test_layers.py
    graph = edges()
    rooms = defaultdict(set)
    for a, targets in graph.items():
        rooms[room_of(a)] |= {room_of(b) for b in targets} - {room_of(a)}
    for name, members in LAYERS:
        for room in sorted(members):
            print(f"{name:>11}  {room:<16} -> {', '.join(sorted(rooms[room])) or '-'}")


if __name__ == "__main__":
    _print_graph()
