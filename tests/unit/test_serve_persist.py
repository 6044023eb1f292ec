"""serve.persist's hand-over against scripted nodes with a systemd of their own: all units start
and the endpoint serves, or the previous deployment is back (exact commands, end state)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field

import pytest

from sparkdeploy.core import labels
from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.packaged import helper
from sparkdeploy.engines import NodeFacts, launch
from sparkdeploy.engines.base import run_args
from sparkdeploy.helpers import serve_unit
from sparkdeploy.steps import serve, serve_persist
from tests.unit.fakes import WALL
from tests.unit.serve_fakes import FakeNode
from tests.unit.test_serve import IMG, healthy_sglang, lab  # noqa: F401 - the fixture

UNIT = "sparkdeploy-sglang.service"
SPEC = f"{serve_persist.NODE_DIR}/sglang.json"
UNIT_FILE = f"/etc/systemd/system/{UNIT}"
KEY = f"{serve_persist.NODE_DIR}/sglang.key"
RESTARTS = f"{serve_persist.NODE_DIR}/sglang.restarts.json"
ADOPT = f"{serve_persist.NODE_DIR}/sglang.adopt"
FAILS = "Job for sparkdeploy-sglang.service failed because the control process exited with error code."


@dataclass
class Systemd:
    """One node's files and units, as the persisted deployment's commands see them."""

    files: dict[str, str] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)
    enabled: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)
    fail_start: int = 0
    """How many of the next ``systemctl start`` fail."""
    gives_up: str | None = None
    """The unit starts no container and writes this restart record (its supervisor gave up)."""
    adopted: list[list[str]] = field(default_factory=list)
    """What each start of the unit kept running (``serve_unit``'s adoption)."""


def with_systemd(node: FakeNode) -> Systemd:
    sd = Systemd()
    answer = node.answer

    def containers(unit: str) -> list[dict]:
        spec = json.loads(sd.files[SPEC])
        return [c for st in spec["stages"] for c in st["containers"] if c["node"] == node.name]

    def systemctl(verb: str, units: list[str]) -> tuple[int, str, str]:
        if verb == "daemon-reload":
            return 0, "", ""
        if verb == "is-active":
            return 0, "".join("active\n" if u in sd.running else "inactive\n" for u in units), ""
        if verb == "is-enabled":
            return 0, "".join("enabled\n" if u in sd.enabled else "disabled\n" for u in units), ""
        [u] = units
        if verb in ("enable", "disable"):
            (sd.enabled.add if verb == "enable" else sd.enabled.discard)(u)
        elif verb == "start" and u not in sd.running:
            if sd.fail_start:
                sd.fail_start -= 1
                return 1, "", FAILS
            sd.running.add(u)
            if sd.gives_up is not None:  # it gave up: its node's containers go, kept or not
                sd.files.pop(ADOPT, None)
                sd.files[RESTARTS] = sd.gives_up
                node.docker(["rm", "--force", "--volumes", *[c["name"] for c in containers(u)]],
                            node.clock(), None)
                return 0, "", ""
            group = serve_unit.Group(json.loads(sd.files[SPEC]), clock=lambda: WALL + node.clock(),
                                     run=lambda argv, **kw: subprocess.CompletedProcess(
                                         argv, *node.answer(argv, None)))
            kept = group.adopt(sd.files.pop(ADOPT, None))  # the hand-over's one-shot file
            sd.adopted.append(sorted(kept))
            if not kept:  # its supervisor runs this node's containers afresh
                node.docker(["rm", "--force", "--volumes", *[c["name"] for c in containers(u)]],
                            node.clock(), None)
                for c in containers(u):
                    node.docker(group.run_args(c), node.clock(), None)
        elif verb == "stop" and u in sd.running:
            sd.running.discard(u)
            node.docker(["rm", "--force", "--volumes", *[c["name"] for c in containers(u)]],
                        node.clock(), None)
        return 0, "", ""

    def files(argv: list[str], stdin: str | None) -> tuple[int, str, str] | None:
        if argv[:2] == ["sha256sum", "--"]:
            import hashlib

            got = sd.files.get(argv[2])
            return (0, f"{hashlib.sha256(got.encode()).hexdigest()}  {argv[2]}\n", "") \
                if got is not None else (1, "", "No such file or directory")
        if argv[:2] == ["cat", "--"] and argv[2] in sd.files:
            return 0, sd.files[argv[2]], ""
        if argv[:2] == ["rm", "-f"]:
            for p in argv[3:]:
                sd.files.pop(p, None)
            return 0, "", ""
        if argv[:2] != ["sh", "-c"]:
            return None
        script, args = argv[2], argv[4:]
        if 'cat > "$1.part"' in script:  # put_file, through stdin
            path, sd.modes[args[0]] = args
            if ".previous" in script:
                sd.files.pop(path + ".previous", None)
                if path in sd.files:
                    sd.files[path + ".previous"] = sd.files[path]
            sd.files[path] = stdin
            return 0, "", ""
        if script.startswith("for f; do if"):  # restore_files
            for p in args:
                prev = sd.files.pop(p + ".previous", None)
                if prev is None:
                    sd.files.pop(p, None)
                else:
                    sd.files[p] = prev
            return 0, "", ""
        if script.startswith("for f; do [ -e"):  # installed
            return 0, "".join(p + "\n" for p in args if p in sd.files), ""
        return None

    def answer_with_systemd(argv: list[str], stdin: str | None) -> tuple[int, str, str]:
        if argv[:3] == ["sudo", "-n", "--"]:
            argv = argv[3:]
        if argv[0] == "systemctl":
            sd.calls.append(argv)
            rest = [a for a in argv[2:] if a != "--"]
            return systemctl(argv[1], rest)
        got = files(argv, stdin)
        return got if got is not None else answer(argv, stdin)

    sd.calls = []  # type: ignore[attr-defined]
    node.answer = answer_with_systemd  # type: ignore[method-assign]
    return sd


@pytest.fixture
def units(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    sds = {name: with_systemd(n) for name, n in nodes.items()}
    return dep, ctx, nodes, cluster, sds


def serving_containers(nodes) -> dict[str, list[str]]:
    now = nodes["spark1"].clock()
    return {n: sorted(c.name for c in node.containers.values() if c.status(now)[0] == "running")
            for n, node in nodes.items()}


def test_a_start_failing_on_the_head_brings_serve_ups_containers_back(units):
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    up_runs = {n: [c.run_argv for c in node.containers.values()] for n, node in nodes.items()}
    started = (f"--label={labels.STARTED}=", f"--label={labels.STARTED_BY}=serve.up")
    assert all(any(a.startswith(started[0]) for a in argv) and started[1] in argv
               for runs in up_runs.values() for argv in runs)
    sds["spark1"].fail_start = 1
    [res] = serve_persist.persist(dep)
    assert res.status is Status.FAILED
    assert res.why == f"spark1: systemctl start {UNIT}: {FAILS}; rolled back: serve.up's sglang containers"
    # the worker's unit started, the head's failed: both stopped, disabled, their files gone
    assert [(n, c[1:]) for n in ("spark1", "spark2") for c in sds[n].calls] == [
        ("spark1", ["is-enabled", "--", UNIT]), ("spark1", ["is-active", "--", UNIT]),
        ("spark1", ["daemon-reload"]), ("spark1", ["enable", "--", UNIT]),
        ("spark1", ["start", "--", UNIT]), ("spark1", ["stop", "--", UNIT]),
        ("spark1", ["daemon-reload"]), ("spark1", ["disable", "--", UNIT]),
        ("spark2", ["is-enabled", "--", UNIT]), ("spark2", ["is-active", "--", UNIT]),
        ("spark2", ["daemon-reload"]), ("spark2", ["enable", "--", UNIT]),
        ("spark2", ["start", "--", UNIT]), ("spark2", ["stop", "--", UNIT]),
        ("spark2", ["daemon-reload"]), ("spark2", ["disable", "--", UNIT])]
    starts = [a for a, argv in ctx.calls if argv[3:5] == ["systemctl", "start"]]
    assert starts == ["spark2", "spark1"]  # workers first
    for sd in sds.values():
        assert sd.files == {} and sd.enabled == set() and sd.running == set()
    # serve.up's containers run again, from the same docker run argv, and the endpoint serves
    assert serving_containers(nodes) == {"spark1": ["sparkdeploy-sglang-head"],
                                         "spark2": ["sparkdeploy-sglang-worker"]}
    def unstamped(runs):  # the same containers, started again (a later time)
        return {n: [[a for a in argv if not a.startswith(started[0])] for argv in r]
                for n, r in runs.items()}

    assert unstamped({n: [c.run_argv for c in node.containers.values()]
                      for n, node in nodes.items()}) == unstamped(up_runs)
    assert cluster.listening(30000)


def test_a_failed_re_persist_puts_the_previous_units_back(units):
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    assert serve_persist.persist(dep)[-1].status is Status.OK
    old = {n: dict(sd.files) for n, sd in sds.items()}
    for sd in sds.values():  # an older spec on the nodes: persist hands over again
        sd.files[SPEC] = sd.files[SPEC].replace('"ready_timeout_s": 600', '"ready_timeout_s": 60')
    before = {n: dict(sd.files) for n, sd in sds.items()}
    sds["spark1"].fail_start = 1
    for sd in sds.values():
        sd.calls.clear()
    [res] = serve_persist.persist(dep)
    assert res.status is Status.FAILED
    assert res.why == f"spark1: systemctl start {UNIT}: {FAILS}; rolled back: the previous {UNIT}"
    for n, sd in sds.items():
        assert sd.files == before[n] != old[n]  # the older spec back, no copy left beside it
        assert sd.enabled == {UNIT} and sd.running == {UNIT}
    assert [c[1:] for c in sds["spark2"].calls] == [
        ["is-enabled", "--", UNIT], ["is-active", "--", UNIT], ["daemon-reload"],
        ["enable", "--", UNIT], ["stop", "--", UNIT], ["start", "--", UNIT],
        ["stop", "--", UNIT], ["daemon-reload"], ["start", "--", UNIT]]
    assert serving_containers(nodes) == {"spark1": ["sparkdeploy-sglang-head"],
                                         "spark2": ["sparkdeploy-sglang-worker"]}


def test_a_persist_that_starts_every_unit_keeps_no_previous_copy(units):
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    before = {n: {c.name: (c.id, c.started) for c in node.containers.values()}
              for n, node in nodes.items()}
    n = len(ctx.calls)
    results = serve_persist.persist(dep)
    # the engine's containers listed once per node: the refusal, the adoption and what ran
    # before read the same listing
    assert [a for a, argv in ctx.calls[n:] if "ps" in argv and "--all" in argv] == ["spark1", "spark2"]
    assert [(r.status, r.node, r.why) for r in results] == [
        (Status.CHANGED, "spark2", f"{UNIT} written, enabled and started; it adopted "
                                   "sparkdeploy-sglang-worker, kept running"),
        (Status.CHANGED, "spark1", f"{UNIT} written, enabled and started; it adopted "
                                   "sparkdeploy-sglang-head, kept running"),
        (Status.OK, None, "endpoint: http://10.0.0.1:30000 (under systemd)")]
    # what serve.up started serves on, adopted by the units: not one container restarted
    assert {n: {c.name: (c.id, c.started) for c in node.containers.values()}
            for n, node in nodes.items()} == before
    assert {n: sd.adopted for n, sd in sds.items()} == {
        "spark1": [["sparkdeploy-sglang-head"]], "spark2": [["sparkdeploy-sglang-worker"]]}
    assert all(sd.modes[ADOPT] == "0600" for sd in sds.values())  # read once, gone (below)
    assert not any(n.removed for n in nodes.values())
    want = launch(dep.profile, dep.profile.engines[0],
                  {"spark1": NodeFacts(3, False), "spark2": NodeFacts(3, False)}, image_id=IMG)
    key = sds["spark1"].files[KEY]
    for sd in sds.values():
        assert set(sd.files) == {UNIT_FILE, SPEC, KEY, f"{serve_persist.NODE_DIR}/serve_unit.py",
                                 f"{serve_persist.NODE_DIR}/serve_watchdog.py",
                                 f"{serve_persist.NODE_DIR}/protocol.py"}
        assert sd.enabled == {UNIT} and sd.running == {UNIT}
        # one group key on every node, 0600, sent over stdin: in no command line
        assert sd.files[KEY] == key and len(key.strip()) == 64 and sd.modes[KEY] == "0600"
        assert sd.modes[SPEC] == "0600" and json.loads(sd.files[SPEC])["key"] == KEY
        assert not any(key.strip() in c for c in ctx.commands)
        spec = json.loads(sd.files[SPEC])
        assert [c["run"] for st in spec["stages"] for c in st["containers"]] == [
            run_args(c) for c in want.containers]
        # the watchdog: the profile's policy, the head's own endpoint, where its records go
        assert spec["watch"] == {"watch_s": 30.0, "canary_s": 30.0, "max_restarts": 3,
                                 "window_s": 3600.0, "backoff_s": 30.0, "backoff_max_s": 600.0}
        assert spec["canary"] == {"port": 30000, "model": dep.profile.model.repo}
        assert (spec["engine"], spec["unit"], spec["nodes"]) == ("sglang", UNIT, ["spark1", "spark2"])
        assert sd.files[f"{serve_persist.NODE_DIR}/serve_watchdog.py"] == \
            helper("serve_watchdog.py").read_text()
        assert spec["started_labels"] == {"at": "org.sparkdeploy.started",
                                          "by": "org.sparkdeploy.started.by", "by_value": UNIT}
    # serve.up started them, and their labels say so still
    for node in nodes.values():
        for c in node.containers.values():
            assert f"--label={labels.STARTED_BY}=serve.up" in c.run_argv
    assert serve_persist.persist(dep)[-1].why == f"{UNIT} installed and active on every node"


def test_what_no_longer_runs_the_heads_image_is_started_afresh_by_the_units(units):
    """The engine's tag on the head names another image since serve.up (rebuilt): what runs
    is not what the units would run, so nothing is adopted; serve.up's containers go and the
    supervisors start their own from the new image, saying so in their labels."""
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    new = "sha256:" + "b" * 64
    for node in nodes.values():
        node.images = {ref: new for ref in node.images}
    results = serve_persist.persist(dep)
    assert [(r.status, r.node, r.why) for r in results] == [
        (Status.CHANGED, "spark2", f"{UNIT} written, enabled and started (sparkdeploy-sglang-worker)"),
        (Status.CHANGED, "spark1", f"{UNIT} written, enabled and started (sparkdeploy-sglang-head)"),
        (Status.OK, None, "endpoint: http://10.0.0.1:30000 (under systemd)")]
    assert {n: sd.adopted for n, sd in sds.items()} == {"spark1": [[]], "spark2": [[]]}
    assert not any(ADOPT in sd.files for sd in sds.values())
    for node in nodes.values():
        [c] = node.containers.values()
        assert f"--label={labels.STARTED_BY}={UNIT}" in c.run_argv[:3]
        assert f"--label={labels.IMAGE_ID}={new}" in c.run_argv


def test_secrets_in_the_engines_env_are_not_persisted(units):
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    eng = dep.profile.engines[0].model_copy(update={"env": {"HF_TOKEN": "hf_NotOnTheNodes0123"}})
    dep.profile = dep.profile.model_copy(update={"engines": [eng, *dep.profile.engines[1:]]})
    [res] = serve_persist.persist(dep)
    assert res.status is Status.FAILED
    assert res.why == ("engines[sglang].env: HF_TOKEN would have to be stored on the nodes for a "
                       "unit that comes back at boot (secrets are not); not persisted")
    assert all(sd.files == {} and sd.calls == [] for sd in sds.values())


def test_a_profile_other_than_what_serves_is_refused_before_any_unit(units):
    """deploy.all --recipe R served R's model; serve.persist without --recipe would hand the
    nodes over to the profile's own model: refused, nothing written, R still serving."""
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    model = dep.profile.model.model_copy(update={"path": "/srv/models/other", "repo": "o/other"})
    dep.profile = dep.profile.model_copy(update={"model": model})
    [res] = serve_persist.persist(dep)
    assert res.status is Status.FAILED
    assert res.why == ("sglang on spark1 serves something else than the profile says (model.path, "
                       "model.repo): persisting would replace it; pass --recipe R for the recipe "
                       "serving, or serve.up first")
    assert all(sd.files == {} and sd.calls == [] for sd in sds.values())
    assert serving_containers(nodes) == {"spark1": ["sparkdeploy-sglang-head"],
                                         "spark2": ["sparkdeploy-sglang-worker"]}


def test_a_hand_over_ends_when_the_heads_unit_gives_up(units):
    """The units start, but the head's supervisor spends its restart budget (a worker that never
    answers): persist does not wait out the readiness deadline; it rolls back at once, naming
    the record."""
    dep, ctx, nodes, cluster, sds = units
    assert serve.up(dep)[-1].status is Status.OK
    sds["spark1"].gives_up = json.dumps({"restarts": [{
        "at": "2026-12-07T04:53:07Z", "by": UNIT, "outcome": "gave-up", "restart": 4,
        "why": "worker spark2 does not answer", "kind": "group"}]})
    t0 = nodes["spark1"].clock()
    [res] = serve_persist.persist(dep)
    assert res.status is Status.FAILED
    assert res.why.startswith(
        f"the head's unit gave up at 2026-12-07T04:53:07Z by {UNIT}: worker spark2 does not "
        "answer; the group stays down; rolled back: serve.up's sglang containers"), res.why
    assert nodes["spark1"].clock() - t0 < dep.profile.serve.ready_timeout_s / 10
    assert serving_containers(nodes) == {"spark1": ["sparkdeploy-sglang-head"],
                                         "spark2": ["sparkdeploy-sglang-worker"]}


def test_idle_writes_the_units_neither_started_nor_enabled_and_a_rerun_changes_nothing(units):
    """A model on demand (serve.add --on-demand): its units written for the gateway to start;
    nothing runs, nothing comes up at boot."""
    dep, ctx, nodes, cluster, sds = units
    results = serve_persist.persist(dep, engine="sglang", idle=True)
    assert [(r.status, r.node, r.why) for r in results] == [
        (Status.CHANGED, "spark1", f"{UNIT} written, not started: on demand"),
        (Status.CHANGED, "spark2", f"{UNIT} written, not started: on demand")]
    for sd in sds.values():
        assert {UNIT_FILE, SPEC, KEY} <= set(sd.files) and not any(f.endswith(".previous") for f in sd.files)
        assert sd.enabled == set() and sd.running == set()
        assert not [c for c in sd.calls if c[1] in ("start", "enable")]
    assert not any(node.containers for node in nodes.values())
    again = serve_persist.persist(dep, engine="sglang", idle=True)
    assert [(r.status, r.node, r.why) for r in again] == [
        (Status.OK, "spark1", f"{UNIT} installed, not loaded: on demand"),
        (Status.OK, "spark2", f"{UNIT} installed, not loaded: on demand")]
    # started by whatever loads it: a re-run leaves it running
    sds["spark1"].running.add(UNIT)
    assert serve_persist.persist(dep, engine="sglang", idle=True)[0].why == \
        f"{UNIT} installed, loaded: on demand"
