"""The shape of the code: no import circles, layers inside `serving/` that import only
downwards, no mixin classes, no oversized files. Read from the source (ast), nothing imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kimi_linear_jax", "kernels", "serving")
# A module may import only from its own floor and the floors below (serving/ itself is the top).
FLOORS = {"serving.core": 0, "serving.speculative": 1, "serving": 2}
MAX_LINES = 450


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: pathlib.Path, known) -> set[str]:
    """The project modules `path` imports (TYPE_CHECKING and function-level imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` depends on mod; `from mod import name` on mod.
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
                break
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def floor(module: str) -> int | None:
    for prefix, level in FLOORS.items():
        if module == prefix or module.startswith(prefix + "."):
            return level
    return None


def test_no_import_circles():
    assert cycles(graph()) == []


def test_serving_imports_only_downwards():
    """serving.core imports nothing else of serving/, serving.speculative only serving.core
    and itself: no import runs back up."""
    upward = [
        f"{a} -> {b}"
        for a, targets in graph().items()
        if floor(a) is not None
        for b in targets
        if floor(b) is not None and floor(b) > floor(a)
    ]
    assert upward == []


def test_no_mixins_and_no_oversized_files():
    mixins, long = [], []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        mixins += [f"{name}.{c.name}" for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
        if len(path.read_text().splitlines()) > MAX_LINES:
            long.append(name)
    assert [m for m in mixins if m.endswith("Mixin")] == []
    assert long == []


def test_the_checks_see_a_circle_and_an_upward_import():
    """The checks themselves: a circle and an upward import are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert (
        floor("serving.core.scheduler")
        < floor("serving.speculative.verify")
        < floor("serving.engine")
    )
