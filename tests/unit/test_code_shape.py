"""The shape of the code: no import circle in src/ (function-level imports count; imports under
``if TYPE_CHECKING:`` never run and do not), none between packages, the product never imports
the lab or the repository's tools (``tools/``: the lab's benchmarks, the manifest maker), the
layers by folder (each folder imports only the folders below it), one atomic write, one thread
pool, no long function, every engine kind in its one module (named nowhere else, found through
``engines.KINDS``), a plan that names steps and options only (each step declares the rest), a
fingerprint that says when it asks a node.

A function's length is its lines minus its docstring and minus multi-line data literals
(dicts, lists, tuples, sets, strings: tables and templates read as data, not logic). The lab's
stand-ins (programs that play a node's tools) are exempt from the length check.

Node-side helpers (``sparkdeploy/helpers/``, standard library only) cannot use the package's helpers:
they are counted on their own."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
TESTS = ROOT / "tests"
PKG = SRC / "sparkdeploy"
HELPERS = PKG / "helpers"
STANDINS = PKG / "lab" / "standins"
MAX_LINES = 80
CORE = PKG / "core"
ATOMIC_WRITE_HELPER = CORE / "files.py"
NODE_TOOLKIT = HELPERS / "protocol.py"
"""The node helpers' one atomic write, deadline and retry."""
CONTROLLER_WAIT = CORE / "wait.py"
"""The controller's one deadline loop (``wait_for``) and one retry (``retry``)."""
SHELL_RENAMES_ALLOWED = {
    "src/sparkdeploy/node/hosts.py put_file": "the one way a file is written on a node",
    "src/sparkdeploy/node/nodeops.py <module>": "the stage script's put(): a helper staged under its sha256, "
    "checked before it is renamed into place, in the one round trip that stages its protocol too",
    "src/sparkdeploy/ops/serve.py restore_files": "the version Host.put_file(keep_previous=True) kept, "
    "put back",
}
"""``path function`` of each shell command that renames a file into place on a node, with why."""
POOL_HELPER = CORE / "threads.py"


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(n: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports for annotations only."""
    t = n.test if isinstance(n, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING"
            or isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (never run)."""
    todo = [tree]
    while todo:
        n = todo.pop()
        yield n
        todo += [c for c in ast.iter_child_nodes(n) if not _type_checking(c)]


def imports(path: Path, modules: set[str], lazy: bool = True, src: Path = SRC) -> set[str]:
    """The package's modules that ``path`` imports: at module level, and with ``lazy`` in
    function bodies too (a circle hidden in a function is still a circle). An import under
    ``if TYPE_CHECKING:`` is for annotations only and never runs: not counted (an engine
    module names the profile's types so; the profile reads the kinds from their registry)."""
    me = module_name(path, src)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    for n in _runtime_nodes(tree) if lazy else tree.body:
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
    files = [f for f in sorted(root.rglob("*.py"))
             if not any(part in skip for part in f.relative_to(root).parts)]
    return long_functions_in(files, root.parent, limit)


def long_functions_in(files: list[Path], base: Path, limit: int = MAX_LINES) -> list[str]:
    out = []
    for f in files:
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = set(range(n.lineno, n.end_lineno + 1)) - _literal_lines(n)
                if len(span) > limit:
                    out.append(f"{f.relative_to(base)}:{n.lineno} {n.name}: {len(span)} lines")
    return out


def test_the_graph_sees_real_imports():
    g = import_graph()
    assert "sparkdeploy.lab.daemons" in g["sparkdeploy.lab.internet"]
    assert "sparkdeploy.profile.overlays" in g["sparkdeploy.profile.config"]


def test_no_long_function_in_the_lab():
    # the stand-ins (node-side programs) are checked on their own
    assert long_functions(PKG / "lab", skip=("standins",)) == []


def test_the_length_check_counts_code_not_data(tmp_path):
    code = "def f():\n    '''doc\n    more'''\n" + "    x = 1\n" * 81
    data = "def g():\n    return [\n" + "        1,\n" * 200 + "    ]\n"
    (tmp_path / "m.py").write_text(code + data)
    assert [s.split(" ", 1)[1] for s in long_functions(tmp_path)] == ["f: 82 lines"]


def product_code() -> list[Path]:
    """The controller's Python: the package (the stand-ins aside: they run as a node's tools)
    and the invoke/nox entry points."""
    return [f for f in sorted(PKG.rglob("*.py")) if not {STANDINS, HELPERS} & set(f.parents)] + [
        ROOT / "tasks.py", ROOT / "noxfile.py"]


def call_sites(files: list[Path], base: Path = ROOT) -> Iterator[tuple[str, ast.Call]]:
    """Every call in ``files``, with its ``path:line``."""
    for f in files:
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Call):
                yield f"{f.relative_to(base)}:{n.lineno}", n


def calls(files: list[Path], dotted: str, base: Path = ROOT) -> list[str]:
    """Where ``dotted`` (``os.replace``, or a bare name) is called."""
    mod, _, name = dotted.rpartition(".")
    out = []
    for where, n in call_sites(files, base):
        fn = n.func
        hit = (isinstance(fn, ast.Attribute) and fn.attr == name
               and (not mod or isinstance(fn.value, ast.Name) and fn.value.id == mod.split(".")[-1])
               ) or (not mod and isinstance(fn, ast.Name) and fn.id == name)
        if hit:
            out.append(where)
    return out


def test_no_import_circle_in_src_counting_function_level_imports():
    assert circle(import_graph(lazy=True)) is None


def test_no_product_module_imports_the_lab():
    # the lab's own modules and its tasks may (and the lab's benchmarks, tools/perf, outside)
    lab = "sparkdeploy.lab"
    bad = {m: sorted(d for d in deps if _in(d, lab))
           for m, deps in import_graph().items() if not _in(m, lab, "sparkdeploy.tasks.lab")}
    assert {m: d for m, d in bad.items() if d} == {}


# --- the layers, by folder: each imports only the folders below it ----------------------------

LAYERS: list[tuple[str, ...]] = [
    ("helpers", "data"),
    ("core",),
    ("model",),
    ("engines",),
    ("profile",),
    ("node",),
    ("bench",),
    ("ops",),
    ("steps",),
    ("run", "lab"),
    ("tasks",),
    ("cli",),
]
"""The package's folders from the bottom up (docs/architecture.md, "The layers"); the folders
of one row are side by side and import neither the other. ``helpers`` (node-side programs,
standard library only) and ``data`` import nothing of the package; ``cli`` is the installed
command over ``tasks``."""


def layer_of(module: str) -> int | None:
    """The row of ``LAYERS`` that holds ``module`` (``sparkdeploy.node.hosts`` -> ``node``'s);
    None for the package's own ``__init__`` and for a folder no row names."""
    parts = module.split(".")
    if parts[0] != "sparkdeploy" or len(parts) < 2:
        return None
    return next((i for i, row in enumerate(LAYERS) if parts[1] in row), None)


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """``module -> dependency`` for each import of a folder on the same row or above (a module
    of the same folder aside), and ``module: no layer`` for a module in no row's folder."""
    out = []
    for m, deps in sorted(graph.items()):
        me = layer_of(m)
        if me is None:
            out += [] if m == "sparkdeploy" else [f"{m}: no layer"]
            continue
        for d in sorted(deps):
            if d.split(".")[:2] == m.split(".")[:2]:
                continue
            theirs = layer_of(d)
            if theirs is None or theirs >= me:
                out.append(f"{m} -> {d}")
    return out


def test_each_folder_imports_only_the_folders_below_it():
    # function-level imports count (a layer reached from a function is still reached); an import
    # under ``if TYPE_CHECKING:`` is for annotations only (the engine kinds name the profile so)
    assert layer_breaches(import_graph()) == []


def test_no_module_lies_flat_in_the_package_but_the_command():
    flat = sorted(f.name for f in PKG.glob("*.py"))
    assert flat == ["__init__.py", "cli.py"]
    folders = {d.name for d in PKG.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    assert folders == {name for row in LAYERS for name in row} - {"cli"}


def test_the_layer_check_sees_a_folder_reaching_up_or_sideways():
    graph = {"sparkdeploy.core.errors": set(), "sparkdeploy.core.events": {"sparkdeploy.core.errors"},
             "sparkdeploy.node.hosts": {"sparkdeploy.core.events", "sparkdeploy.ops.serve"},
             "sparkdeploy.run.plan": {"sparkdeploy.lab.layout"}, "sparkdeploy.misc": set(),
             "sparkdeploy": set()}
    assert layer_breaches(graph) == ["sparkdeploy.misc: no layer", "sparkdeploy.node.hosts -> sparkdeploy.ops.serve",
                                     "sparkdeploy.run.plan -> sparkdeploy.lab.layout"]


def test_the_package_imports_no_tool_of_the_repository():
    # tools/ (the lab's benchmarks, the manifest maker) is outside the package and its wheel
    assert not (PKG / "perf").exists() and not (PKG / "flagmaker.py").exists()
    bad = [f"{f.relative_to(ROOT)}:{n.lineno}" for f in sorted(PKG.rglob("*.py"))
           for n in ast.walk(ast.parse(f.read_text()))
           if isinstance(n, ast.Import) and any(_in(a.name, "tools") for a in n.names)
           or isinstance(n, ast.ImportFrom) and not n.level and _in(n.module or "", "tools")]
    assert bad == []


def test_the_docker_sdk_is_the_labs_alone():
    # the product drives docker through its CLI on the nodes; the SDK is the lab's extra
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"docker\b", d)]
    assert [d for d in project["optional-dependencies"]["lab"] if re.match(r"docker\b", d)]
    users = {module_name(f) for f in sorted(PKG.rglob("*.py"))
             for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.Import) and any(_in(a.name, "docker") for a in n.names)
             or isinstance(n, ast.ImportFrom) and not n.level and _in(n.module or "", "docker")}
    assert users and all(_in(m, "sparkdeploy.lab") for m in users), users


def test_one_place_renames_a_file_into_place():
    outside = [c for c in calls(product_code(), "os.replace")
               if not c.startswith(str(ATOMIC_WRITE_HELPER.relative_to(ROOT)))]
    assert outside == []
    # the node helpers: protocol.write_atomic (staged beside each of them) is their one
    helpers = [h for h in sorted(HELPERS.glob("*.py")) if h != NODE_TOOLKIT]
    assert calls(helpers, "os.replace") + calls(helpers, "os.rename") == []
    # and what the controller writes on a node: Host.put_file (the shell's rename into place)
    assert shell_renames(product_code()) == sorted(SHELL_RENAMES_ALLOWED)


def test_one_place_makes_a_thread_pool():
    sites = calls(product_code(), "ThreadPoolExecutor") + calls(product_code(),
                                                                "futures.ThreadPoolExecutor")
    assert len(sites) <= 2, sites
    assert all(s.startswith(str(POOL_HELPER.relative_to(ROOT))) for s in sites), sites


def test_the_pool_is_the_only_thing_threads_offers_and_nothing_else_makes_one():
    # one fan-out over nodes (StepContext.each), built on the pool; no threads.each/together
    assert public_functions(POOL_HELPER) == ["pool"]
    made = [f"{f.relative_to(ROOT)}:{n.lineno}" for f in product_code() if f != POOL_HELPER
            for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, ast.ImportFrom) and any(a.name == "ThreadPoolExecutor" for a in n.names)
            or isinstance(n, ast.Attribute) and n.attr == "ThreadPoolExecutor"]
    assert made == []


RESULTS = CORE / "outcomes.py"
BUILDERS = {"ok", "changed", "skipped", "failed"}


def test_steps_report_through_their_context_not_through_result_builders():
    # what is left of results.py: the Result, its Status and final(); a status is said with
    # ctx.ok/changed/skipped/failed, or (outside a step: the lab) Result(name, Status.X, ...)
    assert public_functions(RESULTS) == ["final"]
    imported = [f"{f.relative_to(ROOT)}:{n.lineno}" for f in product_code() + sorted(TESTS.rglob("*.py"))
                for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, ast.ImportFrom) and n.module == "sparkdeploy.core.outcomes"
                and BUILDERS & {a.name for a in n.names}]
    assert imported == []
    assert [c for b in sorted(BUILDERS) for c in calls(product_code(), f"results.{b}")] == []


WRITERS = {CORE / "files.py", CORE / "records.py"}
"""The two places a file is written: a record (``Records.write``) or any other file, whole or
not at all (``files.write_atomic`` and its kin)."""
WRITES_ALLOWED: dict[str, str] = {}
"""``path:line`` of a write outside the writers, each with why it may be (none today)."""


def file_writes(files: list[Path], base: Path = ROOT) -> list[str]:
    """Where a file is written in place: ``.write_text(...)``, ``.write_bytes(...)``, or a
    builtin ``open(path, mode)`` / ``<path>.open(mode)`` whose literal mode writes (``w``,
    ``x``, ``+``). An append (``"a"``: the state dir's journal, a line added to known_hosts)
    adds to a file and is not counted; ``tarfile.open`` of a buffer is not a path."""
    out = []
    for where, n in call_sites(files, base):
        fn = n.func
        if isinstance(fn, ast.Attribute) and fn.attr in ("write_text", "write_bytes"):
            out.append(where)
            continue
        builtin = isinstance(fn, ast.Name) and fn.id == "open"
        method = (isinstance(fn, ast.Attribute) and fn.attr == "open"
                  and not (isinstance(fn.value, ast.Name) and fn.value.id in ("tarfile", "os")))
        if not (builtin or method):
            continue
        modes = [k.value for k in n.keywords if k.arg == "mode"]
        modes += n.args[1:2] if builtin else n.args[:1]
        if any(isinstance(m, ast.Constant) and isinstance(m.value, str)
               and set(m.value) & set("wx+") for m in modes):
            out.append(where)
    return out


def test_files_are_written_by_records_or_files_only():
    # the product's Python: the package without the node helpers (standard library only, they
    # cannot import files.py) and the lab (the rehearsal's own stand-ins and state)
    lab = PKG / "lab"
    files = [f for f in product_code() if f not in WRITERS and lab not in f.parents]
    assert [w for w in file_writes(files) if w not in WRITES_ALLOWED] == []


def test_the_write_finder_sees_each_way_of_writing(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import tarfile\n"
                 "p.write_text('x')\n"
                 "p.write_bytes(b'x')\n"
                 "open(p, 'w')\n"
                 "open(p, mode='wb')\n"
                 "p.open('r+')\n"
                 "open(p)\n"
                 "open(p, 'a')\n"
                 "p.read_text()\n"
                 "tarfile.open(fileobj=b, mode='w')\n")
    assert file_writes([f], tmp_path) == [f"m.py:{i}" for i in (2, 3, 4, 5, 6)]


def public_functions(path: Path) -> list[str]:
    return [n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def test_the_call_counter_sees_qualified_and_bare_calls(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom concurrent.futures import ThreadPoolExecutor as T\n"
                 "def g():\n    os.replace('a', 'b')\n    ThreadPoolExecutor(2)\n"
                 "    x.replace('a', 'b')\n")
    assert calls([f], "os.replace", tmp_path) == ["m.py:4"]
    assert calls([f], "ThreadPoolExecutor", tmp_path) == ["m.py:5"]


def test_no_long_function_in_the_product_or_the_node_helpers():
    long = long_functions(PKG, skip=("standins",))
    long += long_functions_in([ROOT / "tasks.py", ROOT / "noxfile.py"], ROOT)
    assert long == []


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


STEPS, OPS, RUNNER, TASKS = "sparkdeploy.steps", "sparkdeploy.ops", "sparkdeploy.run.runner", "sparkdeploy.tasks"
REGISTRY = "sparkdeploy.steps.registry"


def test_no_step_module_imports_another():
    # a step calls another through ctx.call; what steps share lives in ops/, below them
    bad = {m: sorted(d for d in deps if _in(d, STEPS) and d not in (STEPS, REGISTRY))
           for m, deps in import_graph(PKG / "steps").items()}
    assert {m: d for m, d in bad.items() if d} == {}


def test_ops_import_no_step_no_runner_no_task():
    graph = import_graph(PKG / "ops")
    assert {f"{OPS}.serve", f"{OPS}.model", f"{OPS}.image", f"{OPS}.units"} <= set(graph)
    bad = {m: sorted(d for d in deps if _in(d, STEPS, RUNNER, TASKS)) for m, deps in graph.items()}
    assert {m: d for m, d in bad.items() if d} == {}


def test_only_the_task_layer_imports_the_tasks():
    bad = {m: sorted(d for d in deps if _in(d, TASKS))
           for m, deps in import_graph().items() if not _in(m, TASKS, "sparkdeploy.cli")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_nothing_below_the_runner_imports_it():
    graph = import_graph()
    below = {m for m in graph if _in(m, STEPS, OPS)} | graph[RUNNER]
    bad = {m: sorted(d for d in graph[m] if _in(d, RUNNER)) for m in below if m in graph}
    assert {m: d for m, d in bad.items() if d} == {}
    assert {"sparkdeploy.run.plan", REGISTRY} <= graph[RUNNER]  # the check sees what runner imports


# A helper's answer is read in one place (``nodeops``: ``run_helper``, ``parse_report``,
# ``parse_event``); what else parses JSON where helpers are run reads something that is not a
# helper's answer, each said here (by the function, wherever it moves).
NOT_A_HELPERS_ANSWER = {
    "daemon_facts": "``docker info --format {{json .}}``: the Docker CLI's own JSON",
    "layers_on": "``docker image inspect --format {{json .RootFS.Layers}}``: the Docker CLI's",
    "ray_nodes": "a one-line ``python3 -c`` probe run in the engine's container (Ray's nodes)",
    "recorded": "the node's own record file (``cat`` of it), not a helper's output",
    "read_phase": "the head's swap record (``cat`` of it), not a helper's output",
    "read_label": "a container's placement label (``docker ps``'s JSON), not a helper's output",
    "from_spec": "a persisted unit's spec (``cat`` of the node's record), not a helper's output",
    "_node_file": "the gateway's config and record on the head (``cat`` of them), not a helper's output",
    "rx_bytes": "``ip -j -s link``: iproute2's JSON (the perf harness's link counter)",
}
PARSES = ("json.loads", "loads", "last_line", "parsed")


def helper_answer_parses(files: list[Path], base: Path = ROOT) -> list[str]:
    """``path:line function`` of each JSON parse in ``files`` outside the allow-list."""
    out = []
    for f in files:
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name in NOT_A_HELPERS_ANSWER:
                continue
            for n in ast.walk(fn):
                c = n.func if isinstance(n, ast.Call) else None
                name = (f"{c.value.id}.{c.attr}" if isinstance(c, ast.Attribute) and isinstance(c.value, ast.Name)
                        else c.id if isinstance(c, ast.Name) else None)
                if name in PARSES:
                    out.append(f"{f.relative_to(base)}:{n.lineno} {fn.name}")
    return sorted(set(out))


def runs_helpers() -> list[Path]:
    """The steps, the ops below them, and every module that uses ``nodeops`` (itself aside)."""
    graph = import_graph()
    users = {m for m, deps in graph.items() if "sparkdeploy.node.nodeops" in deps}
    return [f for f in product_code() if PKG in f.parents and f.name != "nodeops.py" and (
        {PKG / "steps", PKG / "ops"} & set(f.parents) or module_name(f) in users)
        and (PKG / "lab") not in f.parents]


def test_one_place_reads_a_helpers_answer():
    assert helper_answer_parses(runs_helpers()) == []


def test_the_answer_check_sees_bare_and_qualified_parses_and_spares_the_allowed(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import json\ndef read_it(r):\n    return json.loads(r.stdout)\n"
                 "def daemon_facts(r):\n    return json.loads(r.stdout)\n"
                 "def other(line):\n    return loads(Report, line, 'x'), last_line(Report, line, 'x')\n")
    assert helper_answer_parses([f], tmp_path) == ["m.py:3 read_it", "m.py:7 other"]


# A step declares its whole contract where it is written (convention 15): its needs, and how a
# plan runs it (fingerprint, reuse, redo, when) in its ``@step``, next to its body. A plan
# (``plan.py``) names steps and their options; it holds no per-step settings.
PLAN = PKG / "run" / "plan.py"
FINGERPRINTS = CORE / "fingerprint.py"
PLAN_STEP_FIELDS = ["name", "options", "forced"]
DECLARED = {"fingerprint", "reuse", "redo", "when"}
REACHES_A_NODE = {"image_id", "unit_states", "facts", "host", "hosts", "select", "run", "run_helper",
                  "inspect_image", "probe_units", "moved"}
"""Names through which the controller's code reaches a node: a fact, a host, a command."""


def _names(node: ast.AST) -> set[str]:
    """Every name, attribute and imported name in ``node``."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.ImportFrom):
            out |= {a.asname or a.name for a in n.names}
    return out


def _calls_named(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        isinstance(n.func, ast.Name) and n.func.id == name
        or isinstance(n.func, ast.Attribute) and n.func.attr == name)]


def plan_settings(plan: Path, files: list[Path], base: Path = ROOT) -> list[str]:
    """What a plan module holds that a step declares: a ``PlanStep`` field beyond its name,
    options and ``forced``, a contract keyword given in a call, a table keyed by step names, a
    fingerprint or a node's fact; and any ``PlanStep(...)`` in ``files`` given a contract."""
    tree = ast.parse(plan.read_text())
    where = plan.relative_to(base)
    out = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PlanStep"):
        fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        if fields != PLAN_STEP_FIELDS:
            out.append(f"{where}:{cls.lineno} PlanStep fields {fields}")
    for n in ast.walk(tree):
        said = DECLARED & {k.arg for k in n.keywords} if isinstance(n, ast.Call) else set()
        if said:
            out.append(f"{where}:{n.lineno} {ast.unparse(n.func)}({', '.join(sorted(said))}=...)")
        if isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                           and re.fullmatch(r"[a-z]+\.[a-z-]+", k.value) for k in n.keys):
            out.append(f"{where}:{n.lineno} a table keyed by step names")
    used = _names(tree) & ({"Fingerprint", "flat"} | REACHES_A_NODE - {"moved"})
    out += [f"{where}: {u}" for u in sorted(used)]
    for f in files:
        for c in _calls_named(ast.parse(f.read_text()), "PlanStep"):
            extra = {k.arg for k in c.keywords} - {"forced"}
            if extra or len(c.args) > 2:
                out.append(f"{f.relative_to(base)}:{c.lineno} PlanStep given {sorted(extra) or 'more'}")
    return out


def test_a_plan_names_steps_and_options_and_each_step_declares_the_rest():
    assert plan_settings(PLAN, product_code()) == []


def _function(name: ast.expr, modules: list[ast.Module]) -> ast.AST | None:
    """The function ``name`` stands for: a lambda, or a module-level def in one of ``modules``."""
    if isinstance(name, ast.Lambda):
        return name
    if isinstance(name, ast.Name):
        for m in modules:
            for n in m.body:
                if isinstance(n, ast.FunctionDef) and n.name == name.id:
                    return n
    return None


def unsaid_node_facts(files: list[Path], fingerprints: Path = FINGERPRINTS, base: Path = ROOT) -> list[str]:
    """Each ``Fingerprint(...)`` whose ``also`` (the controller's part) reaches a node, or whose
    ``asks`` (the part said to ask the nodes) does not, or whose part cannot be read here (one
    level deep: a helper that reaches a node on its own is the unit test's to catch,
    ``tests/unit/test_facts.py``)."""
    shared = ast.parse(fingerprints.read_text())
    out = []
    for f in files:
        tree = ast.parse(f.read_text())
        for c in _calls_named(tree, "Fingerprint"):
            for k in c.keywords:
                fn = _function(k.value, [tree, shared])
                reaches = fn is not None and bool(_names(fn) & REACHES_A_NODE)
                if fn is None or (k.arg == "also" and reaches) or (k.arg == "asks" and not reaches):
                    out.append(f"{f.relative_to(base)}:{c.lineno} {k.arg}={ast.unparse(k.value)}")
    return sorted(out)


def test_a_fingerprint_that_asks_a_node_says_so():
    steps = sorted((PKG / "steps").glob("*.py"))
    assert unsaid_node_facts(steps) == []
    made = [f"{f.relative_to(ROOT)}:{c.lineno}" for f in product_code() if f not in steps + [FINGERPRINTS]
            for c in _calls_named(ast.parse(f.read_text()), "Fingerprint")]
    assert made == []  # declared with the steps only


def test_the_plan_and_fingerprint_checks_see_what_they_look_for(tmp_path):
    plan = tmp_path / "plan.py"
    plan.write_text("class PlanStep:\n    name: str\n    options: dict\n    reuse: bool = False\n"
                    "FP = {'serve.up': 1}\n"
                    "from sparkdeploy.ops.image import image_id\n"
                    "p = PlanStep('serve.up', {}, redo='serve.down')\n")
    assert plan_settings(plan, [plan], tmp_path) == [
        "plan.py:1 PlanStep fields ['name', 'options', 'reuse']", "plan.py:5 a table keyed by step names",
        "plan.py:7 PlanStep(redo=...)", "plan.py: image_id", "plan.py:7 PlanStep given ['redo']"]
    step = tmp_path / "step.py"
    step.write_text("def quiet(dep):\n    return {'x': image_id(dep, 'x')}\n"
                    "def loud(dep):\n    return {'x': dep.profile.x}\n"
                    "@step('a.b', fingerprint=Fingerprint('x', also=quiet, asks=loud))\n"
                    "def b(ctx): ...\n"
                    "@step('a.c', fingerprint=Fingerprint(also=head, asks=lambda d: d.facts.get(1)))\n"
                    "def c(ctx): ...\n"
                    "F = Fingerprint(also=elsewhere)\n")
    shared = tmp_path / "fingerprint.py"
    shared.write_text("def head(dep):\n    return {'head': dep.profile.head.name}\n")
    assert unsaid_node_facts([step], shared, tmp_path) == [
        "step.py:5 also=quiet", "step.py:5 asks=loud", "step.py:9 also=elsewhere"]


# --- one error tree (sparkdeploy.core.errors) -----------------------------------------------------------
ERRORS = CORE / "errors.py"


def product_modules() -> list[str]:
    """The product's importable modules: the package without the lab, its benchmarks and the
    node helpers (standard library only: their errors never cross the wire as classes)."""
    skip = (PKG / "lab", HELPERS)
    return [module_name(f) for f in sorted(PKG.rglob("*.py"))
            if not any(s == f.parent or s in f.parents for s in skip)]


def test_every_error_of_the_product_is_below_one_base():
    import importlib
    import inspect

    from sparkdeploy.core.errors import Error, RunError, StepFailed, UsageError

    assert (UsageError.code, RunError.code, StepFailed.code) == (2, 1, 1)
    outside = []
    for name in product_modules():
        mod = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException) and not issubclass(cls, Error):
                outside.append(f"{name}.{cls_name}")
    assert outside == []
    # the base alone derives from a builtin exception; each kind below it says its exit code
    assert [c.__name__ for c in Error.__subclasses__()] == ["UsageError", "RunError", "StepFailed"]


def failing_handlers(files: list[Path], base: Path = ROOT) -> list[str]:
    """``path:line`` of each ``except`` whose body calls ``<x>.failed(...)``: an error turned
    into a failed result by hand, not by the step's context."""
    out = []
    for f in files:
        for h in ast.walk(ast.parse(f.read_text())):
            if isinstance(h, ast.ExceptHandler) and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "failed"
                    for s in h.body for n in ast.walk(s)):
                out.append(f"{f.relative_to(base)}:{h.lineno}")
    return out


def test_no_step_turns_an_error_into_a_failed_result_by_hand():
    # a step raises StepFailed (PartFailed for one node of a fan-out) or lets an error of that
    # kind through, or says ``with ctx.failing(...)``: its context is the one place that makes
    # the failed result (steps/registry.py)
    steps = [f for f in sorted((PKG / "steps").glob("*.py")) if f.name != "registry.py"]
    assert failing_handlers(steps) == []


def scratch(tmp_path: Path, *lines: str) -> list[Path]:
    """A module ``m.py`` of ``lines`` in ``tmp_path``, for a check to read."""
    (tmp_path / "m.py").write_text("".join(f"{ln}\n" for ln in lines))
    return [tmp_path / "m.py"]


def test_the_handler_check_sees_a_failed_result_made_in_an_except(tmp_path):
    src = scratch(tmp_path, "try:", "    x()", "except E as e:", "    ctx.failed(str(e))", "    return",
                  "try:", "    y()", "except E as e:", "    raise StepFailed(str(e)) from None",
                  "try:", "    z()", "except E:", "    if a:", "        return ctx.failed('no')")
    assert failing_handlers(src, tmp_path) == ["m.py:3", "m.py:12"]



# --- one toolkit on each side of the wire ------------------------------------------------------


def _name(call: ast.Call) -> str:
    fn = call.func
    return fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(the enclosing function's name or ``<module>``, node) for every node of ``tree``."""
    def walk(n: ast.AST, where: str) -> Iterator[tuple[str, ast.AST]]:
        for c in ast.iter_child_nodes(n):
            inner = c.name if isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef) else where
            yield inner, c
            yield from walk(c, inner)
    yield from walk(tree, "<module>")


def shell_renames(files: list[Path], base: Path = ROOT) -> list[str]:
    """``path function`` of each string that holds a shell ``mv -f`` (a rename into place)."""
    out = set()
    for f in files:
        for where, n in _functions(ast.parse(f.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and "mv -f" in n.value:
                out.add(f"{f.relative_to(base)} {where}")
    return sorted(out)


def hand_made_loops(files: list[Path], clocks: tuple[str, ...] = ("monotonic",),
                    base: Path = ROOT) -> list[str]:
    """``path:line kind`` of each loop that keeps its own deadline (compares a ``clocks`` reading)
    or retries by hand: it sleeps, and either counts its tries over ``range()`` or has an
    ``except`` that goes round again (not one that breaks, returns or raises)."""
    out = []
    for f in files:
        for loop in ast.walk(ast.parse(f.read_text())):
            if not isinstance(loop, ast.For | ast.While):
                continue
            inside = list(ast.walk(loop))
            if any(isinstance(n, ast.Compare) and any(isinstance(c, ast.Call) and _name(c) in clocks
                                                      for c in ast.walk(n)) for n in inside):
                out.append(f"{f.relative_to(base)}:{loop.lineno} deadline")
            if not any(isinstance(n, ast.Call) and _name(n) == "sleep" for n in inside):
                continue
            counted = isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call) and _name(loop.iter) == "range"
            again = any(isinstance(n, ast.ExceptHandler)
                        and not isinstance(n.body[-1], ast.Break | ast.Return | ast.Raise) for n in inside)
            if counted or again:
                out.append(f"{f.relative_to(base)}:{loop.lineno} retry")
    return out


def test_no_deadline_or_retry_loop_outside_the_toolkits():
    # node side: protocol.Deadline and protocol.retry; controller side: wait.wait_for and
    # wait.retry (an injectable clock: dep.clock counts as a clock there)
    helpers = [h for h in sorted(HELPERS.glob("*.py")) if h != NODE_TOOLKIT]
    assert hand_made_loops(helpers) == []
    controller = [f for f in product_code() if f != CONTROLLER_WAIT
                  and (PKG / "lab") not in f.parents]
    assert hand_made_loops(controller, ("monotonic", "clock")) == []


def test_the_loop_check_sees_deadlines_and_retries_and_spares_a_loop_that_waits_for_work(tmp_path):
    src = scratch(tmp_path,
                  "while time.monotonic() < end:", "    send()",
                  "for _ in range(3):", "    if ok(): break", "    time.sleep(1)",
                  "while True:", "    try:", "        return connect()", "    except OSError:",
                  "        time.sleep(0.1)",
                  "while busy():", "    try:", "        q.get_nowait()", "    except Empty:", "        break",
                  "    time.sleep(0.02)")
    assert hand_made_loops(src, base=tmp_path) == ["m.py:1 deadline", "m.py:3 retry", "m.py:6 retry"]


OUTSIDE = CORE / "outside.py"
NOT_OUTSIDE_DATA = {
    "core/records.py read": "the state dir's own records (RecordError when one does not fit)",
    "engines/flags.py manifest": "the package's own flag manifests (data/engine-flags)",
    "data/metrics_exporter.py read_json": "node-side, in the serving image: the node's own "
                                          "records (metrics.up wrote them), {} when not one",
}
"""``path function`` of a JSON parse that reads no outside data, each with why."""


def json_parses(files: list[Path], base: Path = PKG) -> list[str]:
    """``path function`` of each ``json.loads``/``json.load``/``*.model_validate_json`` call."""
    out = set()
    for f in files:
        for where, n in _functions(ast.parse(f.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                    n.func.attr in ("loads", "load") and isinstance(n.func.value, ast.Name)
                    and n.func.value.id == "json" or n.func.attr == "model_validate_json"):
                out.add(f"{f.relative_to(base)} {where}")
    return sorted(out)


def test_outside_data_is_read_by_outside_only():
    # what a node, an engine, a hub or a user's file answered: outside.parsed/loads/last_line
    files = [f for f in product_code() if PKG in f.parents and f != OUTSIDE
             and (PKG / "lab") not in f.parents]
    assert [p for p in json_parses(files) if p not in NOT_OUTSIDE_DATA] == []


# --- packages: no loop between them ----------------------------------------------------------


def package_of(module: str) -> str:
    """``sparkdeploy.ops.serve`` -> ``sparkdeploy.ops``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(package_of(m), set()).update(
            package_of(d) for d in deps if package_of(d) != package_of(m))
    return out


def test_no_import_circle_between_packages_counting_function_level_imports():
    # engines/ reached up into ops/ (a digest test), bench/ into ops/ (the startup milestones)
    # while ops/ imports both: a loop no module-level circle shows
    assert circle(package_graph(import_graph())) is None


def test_the_package_check_sees_a_loop_no_module_closes():
    graph = {"sparkdeploy.engines": {"sparkdeploy.ops.image"}, "sparkdeploy.ops.image": set(),
             "sparkdeploy.ops.serve": {"sparkdeploy.engines"}}
    assert circle(graph) is None
    assert circle(package_graph(graph)) is not None


# --- the engine kinds (convention 14): one module each, found through engines.KINDS -----------

ENGINES = PKG / "engines"
ENGINES_SHARED = ("__init__.py", "base.py", "rules.py", "flags.py", "diagnose.py")
"""The registry, the interface (``Kind``) and what every kind shares, and the words of its
diagnosis rules: the rest of ``engines/`` is one module per kind."""


def kind_modules() -> list[Path]:
    return [f for f in sorted(ENGINES.glob("*.py")) if f.name not in ENGINES_SHARED]


def test_every_engine_kind_is_one_module_found_through_the_registry():
    import importlib

    from sparkdeploy.engines import KINDS, Kind

    modules = [module_name(f) for f in kind_modules()]
    assert sorted(type(k).__module__ for k in KINDS.values()) == sorted(modules)
    for m in modules:
        kind = importlib.import_module(m).KIND
        assert isinstance(kind, Kind) and KINDS[kind.name] is kind, m
        assert type(kind).build is not Kind.build, f"{m}: no build()"


def test_the_profile_takes_the_kinds_and_software_the_registry_has():
    from typing import get_args

    from sparkdeploy import engines
    from sparkdeploy.profile import config

    assert get_args(config.EngineKind) == tuple(engines.KINDS)
    assert get_args(config.Software) == tuple(engines.software())
    assert set(config._default_rules()) == set(engines.software())


def docstring_constants(tree: ast.AST) -> set[int]:
    """The ``id`` of every docstring's constant (and of any other bare string statement)."""
    return {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


def kind_literals(files: list[Path], names: set[str], base: Path = ROOT) -> list[str]:
    """``path:line 'name'`` of each string in ``files`` that is one of ``names`` (an engine
    kind's or its software's name), docstrings aside: a decision about a kind made outside its
    module."""
    out = []
    for f in files:
        tree = ast.parse(f.read_text())
        docs = docstring_constants(tree)
        out += sorted((n.lineno, f"{f.relative_to(base)}:{n.lineno} {n.value!r}") for n in ast.walk(tree)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
                      and id(n) not in docs)
    return [where for _, where in out]


def kind_names() -> set[str]:
    from sparkdeploy.engines import KINDS

    return {name for k in KINDS.values() for name in (k.name, k.software)}


def test_no_module_outside_engines_names_an_engine_kind():
    # the lab plays the engines (its stand-ins, its images): theirs to name (and tools/perf's, out
    # of the package, which drives the lab)
    files = [f for f in product_code() if not {ENGINES, PKG / "lab"} & set(f.parents)]
    assert kind_literals(files, kind_names()) == []


def test_only_the_registry_and_the_kinds_import_a_kinds_module():
    kinds = {module_name(f) for f in kind_modules()}
    bad = {m: sorted(deps & kinds) for m, deps in import_graph().items()
           if not _in(m, "sparkdeploy.engines")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_kind_finder_sees_a_decision_and_spares_docstrings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""sglang"""\ndef g(e):\n    """vllm"""\n    return e.kind == "vllm-ray" or "sglang:x"\n'
                 'RULES = {"sglang": 1}\n')
    assert kind_literals([f], {"sglang", "vllm", "vllm-ray"}, tmp_path) == [
        "m.py:4 'vllm-ray'", "m.py:5 'sglang'"]


def test_the_node_helpers_report_every_kinds_software():
    # probe_image.py (standard library, no import of the package) reads each software's
    # version from its installed metadata: the packages it reports hold every kind's
    from sparkdeploy import engines
    from sparkdeploy.helpers import probe_image

    assert set(engines.software()) <= set(probe_image.PACKAGES)


# --- imports at the top, unless a circle forces one into a function (say which) ---------------

LAZY_IMPORTS: dict[str, str] = {
    "sparkdeploy.steps.registry": "load_all imports the steps package, whose modules import the registry",
}
"""Product modules that import the package inside a function, each with why (the lab aside: it
drives a lab that may not be built)."""


def lazy_imports(files: list[Path], base: Path = SRC) -> dict[str, list[str]]:
    """``module -> [line: import]`` of the package's imports inside functions (those under
    ``if TYPE_CHECKING:`` aside: they never run)."""
    out: dict[str, list[str]] = {}
    for f in files:
        tree = ast.parse(f.read_text())
        top = {id(n) for n in tree.body}
        for n in _runtime_nodes(tree):
            if id(n) in top or not isinstance(n, ast.Import | ast.ImportFrom):
                continue
            names = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
            if getattr(n, "level", 0) or any(m == "sparkdeploy" or m.startswith("sparkdeploy.") for m in names):
                out.setdefault(module_name(f, base), []).append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_imports_are_at_the_top_unless_a_circle_forces_them_down():
    files = [f for f in product_code() if PKG in f.parents and (PKG / "lab") not in f.parents]
    found = lazy_imports(files)
    assert {m: lines for m, lines in found.items() if m not in LAZY_IMPORTS} == {}


def test_the_lazy_import_finder_spares_the_top_and_type_checking(tmp_path):
    pkg = tmp_path / "sparkdeploy"
    pkg.mkdir()
    (pkg / "m.py").write_text("from sparkdeploy import a\nif TYPE_CHECKING:\n    from sparkdeploy import b\n"
                              "def f():\n    import json\n    from sparkdeploy.c import d\n")
    assert lazy_imports([pkg / "m.py"], tmp_path) == {"sparkdeploy.m": ["6: from sparkdeploy.c import d"]}
