"""brisk's import structure, read from the source with `ast` (nothing is imported): no import
circle between modules, and no import from a lower floor to a higher one. Imports inside functions
count too: a lazy import upward is still a dependency upward."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "brisk"

# bottom to top; a unit is a subpackage (brisk.engine) or a top-level module (brisk.cli)
FLOORS = [
    {"brisk", "brisk.errors", "brisk.switches", "brisk.kv_dtype", "brisk.argtypes", "brisk.fileio", "brisk.cache_dir", "brisk.progress", "brisk.trace",
     "brisk.loop_lag", "brisk.plotting", "brisk.families", "brisk.config", "brisk.text"},
    {"brisk.kernels", "brisk.tokenizer", "brisk.structured"},
    {"brisk.models"},
    {"brisk.loading"},
    {"brisk.engine", "brisk.generate"},
    {"brisk.metrics", "brisk.llm", "brisk.bench", "brisk.kvplan", "brisk.doctor", "brisk.top"},
    {"brisk.server"},
    {"brisk.cluster"},
    {"brisk.cli", "brisk.__main__"},
]
FLOOR = {unit: n for n, units in enumerate(FLOORS) for unit in units}


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str | None:  # the module a dotted import name lands in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(owner(a.name) for a in node.names if a.name.split(".")[0] == "brisk")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "brisk":
                for alias in node.names:  # `from brisk.x import y`: y may be a module of its own
                    full = owner(f"{node.module}.{alias.name}")
                    targets.add(full if full and full.startswith(node.module) else owner(node.module))
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets
    return graph


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_unit_has_a_floor():
    missing = sorted({unit(m) for m in modules()} - set(FLOOR))
    assert not missing, f"add {missing} to FLOORS"


def test_no_import_circle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    assert cycles(graph) == []


def test_no_import_runs_upward():
    upward = sorted(f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
                    if FLOOR[unit(t)] > FLOOR[unit(m)])
    assert upward == []


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_the_graph_sees_lazy_imports(tmp_path):
    """A function-level import counts (the circle through cli.py was made of them)."""
    graph = import_graph()
    assert "brisk.engine.factory" in graph["brisk.cli"]
    assert "brisk.engine.engine" in graph["brisk.engine.factory"]  # imported inside build_engine


def test_the_request_path_stays_small():
    """Issue 36: no function in brisk/server/ over 60 lines, and app.py (the routes) under 300."""
    server = ROOT / "server"
    long = []
    for path in sorted(server.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
    assert len((server / "app.py").read_text(encoding="utf-8").splitlines()) < 300


def test_both_engines_implement_the_engine_client_protocol():
    """The server reads only EngineClient's members; the one-process engine and the Ray ingress's
    remote engine both have every one of them (RemoteEngine is read from source: Ray may be absent)."""
    import inspect

    from brisk.engine.async_engine import AsyncLLMEngine
    from brisk.engine.client import EngineClient

    members = {name for name in dir(EngineClient) if not name.startswith("_")}
    assert {"add", "stats", "stats_by_replica", "model_info", "tokenizer", "fail_all"} <= members
    assert members <= set(dir(AsyncLLMEngine)), members - set(dir(AsyncLLMEngine))
    remote = ast.parse((ROOT / "cluster" / "remote.py").read_text(encoding="utf-8"))
    cls = next(n for n in remote.body if isinstance(n, ast.ClassDef) and n.name == "RemoteEngine")
    defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert members <= defined, members - defined
    assert "SimpleNamespace" not in (ROOT / "cluster" / "remote.py").read_text(encoding="utf-8")
    assert inspect.signature(AsyncLLMEngine.add).parameters.keys() >= {"prompt", "params", "request_id", "sink"}
