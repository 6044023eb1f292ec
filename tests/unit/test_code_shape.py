"""The shape of the code: no import circle in src/, no long function in the lab.

A function's length is its lines minus its docstring and minus multi-line data literals
(dicts, lists, tuples, sets, strings: tables and templates read as data, not logic)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "sparkdeploy"
MAX_LINES = 80


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, modules: set[str], lazy: bool = True, src: Path = SRC) -> set[str]:
    """The package's modules that ``path`` imports: at module level, and with ``lazy`` in
    function bodies too (a circle hidden in a function is still a circle)."""
    me = module_name(path, src)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    for n in ast.walk(tree) if lazy else tree.body:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in n.names}
    # a package's __init__ is not a dependency of its own submodules' siblings
    return {m for m in out if m in modules and m != me and not me.startswith(m + ".")}


def import_graph(root: Path = PKG, lazy: bool = True) -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports(f, modules, lazy) for f in sorted(root.rglob("*.py"))}


def circle(graph: dict[str, set[str]]) -> str | None:
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        return " -> ".join(e.args[1])
    return None


def test_no_import_circle_at_module_level_in_src():
    assert circle(import_graph(lazy=False)) is None


def test_no_import_circle_in_the_lab_even_through_function_level_imports():
    graph = import_graph(PKG / "lab")
    assert circle({m: {d for d in deps if d in graph} for m, deps in graph.items()}) is None


def test_the_circle_check_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "sparkdeploy"
    pkg.mkdir()
    (pkg / "a.py").write_text("from sparkdeploy import b\n")
    (pkg / "b.py").write_text("def f():\n    from sparkdeploy.a import x\n")
    modules = {"sparkdeploy.a", "sparkdeploy.b"}

    def graph(lazy: bool) -> dict[str, set[str]]:
        return {module_name(f, tmp_path): imports(f, modules, lazy, tmp_path)
                for f in sorted(pkg.glob("*.py"))}

    assert graph(lazy=True) == {"sparkdeploy.a": {"sparkdeploy.b"}, "sparkdeploy.b": {"sparkdeploy.a"}}
    assert circle(graph(lazy=True)) is not None
    assert circle(graph(lazy=False)) is None


def _literal_lines(fn: ast.AST) -> set[int]:
    lines: set[int] = set()
    body = getattr(fn, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        lines |= set(range(body[0].lineno, body[0].end_lineno + 1))
    for n in ast.walk(fn):
        if isinstance(n, (ast.Dict, ast.List, ast.Tuple, ast.Set, ast.Constant, ast.JoinedStr)):
            if n.end_lineno and n.end_lineno > n.lineno:
                lines |= set(range(n.lineno, n.end_lineno + 1))
    return lines


def long_functions(root: Path, limit: int = MAX_LINES, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for f in sorted(root.rglob("*.py")):
        if any(part in skip for part in f.relative_to(root).parts):
            continue
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = set(range(n.lineno, n.end_lineno + 1)) - _literal_lines(n)
                if len(span) > limit:
                    out.append(f"{f.relative_to(root.parent)}:{n.lineno} {n.name}: {len(span)} lines")
    return out


def test_the_graph_sees_real_imports():
    g = import_graph()
    assert "sparkdeploy.lab.daemons" in g["sparkdeploy.lab.internet"]
    assert "sparkdeploy.overlays" in g["sparkdeploy.config"]


def test_no_long_function_in_the_lab():
    # the stand-ins (node-side programs) are checked on their own
    assert long_functions(PKG / "lab", skip=("standins",)) == []


def test_the_length_check_counts_code_not_data(tmp_path):
    code = "def f():\n    '''doc\n    more'''\n" + "    x = 1\n" * 81
    data = "def g():\n    return [\n" + "        1,\n" * 200 + "    ]\n"
    (tmp_path / "m.py").write_text(code + data)
    assert [s.split(" ", 1)[1] for s in long_functions(tmp_path)] == ["f: 82 lines"]
