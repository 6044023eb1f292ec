"""serve.gateway, serve.remove and serve.add on scripted nodes: the gateway's exact files and unit,
what a re-run restarts (nothing), the refusals before anything is written, serve.remove taking the
model out of the gateway before it stops its engine."""

from __future__ import annotations

import json

import pytest

from sparkdeploy.core import labels
from sparkdeploy.core.outcomes import Status
from sparkdeploy.model.fit import GIB
from sparkdeploy.node.memory import NodeMemory
from sparkdeploy.ops import gateway as gw
from sparkdeploy.ops.serve_containers import SERVE_DIR
from sparkdeploy.profile.config import Placement
from sparkdeploy.run import placement as run_placement
from sparkdeploy.steps import serve_add as sa
from sparkdeploy.steps.registry import run_one
from tests.unit.fakes import EngineContainer
from tests.unit.test_metrics import ADDR, MetricsNode, dep_of

BASE = "qwen3.5-122b-a10b-fp8"
BASE_REPO = "Qwen/Qwen3.5-122B-A10B-FP8"
UNIT_FILE = f"{gw.UNIT_DIR}/{gw.UNIT}"
PLACED = Placement(of=BASE, recipe="gpt-oss-120b", nodes=["spark2"], offset=1, fraction=0.55)


def own(role: str, port: str) -> dict[str, str]:
    return {labels.DEPLOYMENT: BASE, labels.ENGINE: "vllm", labels.ENGINE_KIND: "vllm",
            labels.ROLE: role, labels.RANK: "0" if role == "head" else "1", labels.PORT: port,
            labels.RECIPE: BASE}


def placed_labels(pl: Placement = PLACED) -> dict[str, str]:
    return {labels.DEPLOYMENT: f"{BASE}.{pl.recipe}", labels.ENGINE: f"{pl.recipe}-vllm",
            labels.ENGINE_KIND: "vllm", labels.ROLE: "head", labels.RANK: "0", labels.PORT: "8001",
            labels.RECIPE: pl.recipe, labels.PLACEMENT: pl.model_dump_json()}


def cluster(placed: bool = True) -> dict[str, MetricsNode]:
    head = MetricsNode(containers=[EngineContainer("sparkdeploy-vllm-head", own("head", "8000"), [1])])
    worker = MetricsNode(containers=[EngineContainer("sparkdeploy-vllm-worker", own("worker", ""), [2])])
    if placed:
        worker.containers.append(EngineContainer("sparkdeploy-gpt-oss-120b-vllm-head", placed_labels(), [3]))
    return {"spark1": head, "spark2": worker}


@pytest.fixture
def listed(monkeypatch):
    """What the gateway lists once it runs: every model it was told of."""
    said: list[str] = []

    def models(url, deadline=5.0):
        said.append(url)
        return [BASE_REPO, "openai/gpt-oss-120b"]

    monkeypatch.setattr(sa.ep, "models", models)
    return said


def writes(node: MetricsNode) -> list[str]:
    return [a[4] for a in node.ran if a[:2] == ["sh", "-c"] and a[2].endswith('mv -f -- "$1.part" "$1"')]


def test_the_gateway_is_written_started_and_a_rerun_restarts_nothing(tmp_path, listed):
    ns = cluster()
    dep, _ = dep_of(tmp_path, ns)
    results = run_one(dep, "serve.gateway")
    assert [(r.status, r.why) for r in results] == [
        (Status.CHANGED, f"started {gw.UNIT} on spark1: {BASE_REPO}, openai/gpt-oss-120b"),
        (Status.OK, "endpoint: http://192.168.1.11:8888")]
    head = ns["spark1"]
    assert writes(head) == [gw.PROGRAM_FILE, gw.TOOLKIT_FILE, gw.CONFIG_FILE, UNIT_FILE]
    assert json.loads(head.node_files[gw.CONFIG_FILE]) == {
        "listen": "0.0.0.0:8888",
        "backends": [{"url": "http://127.0.0.1:8000", "models": [BASE_REPO]},
                     {"url": f"http://{ADDR['spark2']}:8001", "models": ["openai/gpt-oss-120b"]}]}
    assert "ExecStart=/usr/bin/python3 -B /var/lib/sparkdeploy-node/gateway/gateway.py " \
           "--config=/var/lib/sparkdeploy-node/gateway/config.json" in head.node_files[UNIT_FILE]
    assert ["systemctl", "start", "--", gw.UNIT] in head.sudo
    modes = {a[4]: (a[2].split(" && ")[0], a[5:]) for a in head.ran
             if a[:2] == ["sh", "-c"] and a[2].endswith('mv -f -- "$1.part" "$1"')}
    assert modes == {gw.PROGRAM_FILE: ("umask 022", ["0644"]), gw.CONFIG_FILE: ("umask 077", ["0600"]),
                     gw.TOOLKIT_FILE: ("umask 022", ["0644"]), UNIT_FILE: ("umask 022", ["0644"])}
    assert head.units[gw.UNIT] == "active" and listed == ["http://192.168.1.11:8888"]
    head.ran.clear()
    again = run_one(dep, "serve.gateway")
    assert [(r.status, r.why) for r in again] == [
        (Status.OK, f"the gateway routes {BASE_REPO}, openai/gpt-oss-120b, as it did"),
        (Status.OK, "endpoint: http://192.168.1.11:8888")]
    assert writes(head) == [] and not [a for a in head.ran if a[:2] in (["systemctl", "restart"],
                                                                       ["systemctl", "start"])]


def test_the_api_key_reaches_the_node_as_its_digest_only(tmp_path, listed, monkeypatch):
    monkeypatch.setenv("SPARKDEPLOY_API_KEY", "sk-lab-secret")
    ns = cluster()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "serve.gateway")
    head = ns["spark1"]
    assert "api_key_sha256" in json.loads(head.node_files[gw.CONFIG_FILE])
    assert not [f for f, text in head.node_files.items() if "sk-lab-secret" in text]
    assert not [a for a in head.ran if "sk-lab-secret" in " ".join(a)]


def test_a_port_another_program_holds_is_refused_before_anything_is_written(tmp_path, listed):
    ns = cluster()
    ns["spark1"].listening[8888] = "jupyter-lab"
    dep, _ = dep_of(tmp_path, ns)
    results = run_one(dep, "serve.gateway")
    assert [(r.status, r.why) for r in results] == [
        (Status.FAILED, "spark1: port 8888 is held by jupyter-lab (gateway.port)")]
    assert writes(ns["spark1"]) == []


def test_with_nothing_placed_there_is_no_gateway_and_an_old_one_is_removed(tmp_path, listed):
    ns = cluster(placed=False)
    dep, _ = dep_of(tmp_path, ns)
    assert [r.why for r in run_one(dep, "serve.gateway")] == []  # nothing to say, nothing done
    assert writes(ns["spark1"]) == []
    ns["spark1"].node_files.update({UNIT_FILE: "[Unit]\n", gw.CONFIG_FILE: "{}"})
    ns["spark1"].units[gw.UNIT] = "active"
    results = run_one(dep, "serve.gateway")
    assert [(r.status, r.why) for r in results] == [
        (Status.CHANGED, f"removed {gw.UNIT}: no model is placed beside {BASE}")]
    assert ns["spark1"].units[gw.UNIT] == "inactive"
    assert UNIT_FILE not in ns["spark1"].node_files and gw.CONFIG_FILE not in ns["spark1"].node_files


def test_serve_remove_takes_the_model_out_of_the_gateway_before_it_stops_its_engine(
        tmp_path, listed, monkeypatch):
    ns = cluster()
    glm = Placement(of=BASE, recipe="glm-4.5-air-fp8", nodes=["spark1"], offset=2, fraction=0.6)
    ns["spark1"].containers.append(EngineContainer("sparkdeploy-glm-4-5-air-fp8-vllm-head",
                                                   {**placed_labels(glm), labels.PORT: "8002"}, [4]))
    ns["spark1"].node_files[UNIT_FILE] = "[Unit]\n"
    ns["spark1"].units[gw.UNIT] = "active"
    dep, _ = dep_of(tmp_path, ns)
    order: list[str] = []
    real_put = sa._put
    monkeypatch.setattr(sa, "_put", lambda h, p, c, private: order.append(f"put {p}") or real_put(h, p, c, private))
    removed = []

    def rm(dep_, hosts, engine=None):
        order.append(f"rm {dep_.profile.name}")
        removed.append(dep_.profile.name)
        return {}

    monkeypatch.setattr(sa.ep, "models", lambda url, deadline=5.0: [BASE_REPO, "zai-org/GLM-4.5-Air-FP8"])
    from sparkdeploy.steps import serve as serve_step
    monkeypatch.setattr(serve_step, "ours", lambda h, d, engine=None: [])
    monkeypatch.setattr(serve_step, "stop_units", lambda d, h: order.append(f"stop {d.profile.name}") or [])
    results = run_one(dep, "serve.remove", recipe="gpt-oss-120b")
    assert not [r for r in results if r.failed], [(r.step, r.why) for r in results]
    config = json.loads(ns["spark1"].node_files[gw.CONFIG_FILE])
    assert config["backends"] == [{"url": "http://127.0.0.1:8000", "models": [BASE_REPO]},
                                  {"url": "http://127.0.0.1:8002", "models": ["zai-org/GLM-4.5-Air-FP8"]}]
    assert order.index(f"put {gw.CONFIG_FILE}") < order.index(f"stop {BASE}.gpt-oss-120b")
    assert ns["spark1"].units[gw.UNIT] == "active"
    ns["spark1"].ran.clear()
    assert [r.why for r in run_one(dep, "serve.remove", recipe="llama-3.3-70b-instruct")] == [
        f"llama-3.3-70b-instruct is not placed beside {BASE}"]
    assert writes(ns["spark1"]) == [] and ns["spark1"].units[gw.UNIT] == "active"


def mem(usable_gib: float) -> NodeMemory:
    return NodeMemory(gpus=1, unified=True, gpu_total=int(121.7 * GIB), gpu_usable=int(usable_gib * GIB),
                      source="/proc/meminfo")


def test_serve_add_refuses_a_model_the_cluster_serves_and_one_that_fits_nowhere(tmp_path, listed,
                                                                               monkeypatch):
    ns = cluster()
    dep, _ = dep_of(tmp_path, ns)
    out = run_placement.run(dep, BASE)
    assert [(r.status, r.why) for r in out] == [
        (Status.FAILED, f"{BASE_REPO} already serves on the cluster ({BASE}, spark1:8000): one "
                        "engine per model behind the gateway")]
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(20), "spark2": mem(30)})
    out = run_placement.run(dep, "glm-4.5-air-fp8")
    [r] = out
    assert r.status is Status.FAILED and r.why.startswith(
        "recipe glm-4.5-air-fp8 does not fit beside what the cluster serves: on spark1: ")
    assert "spark2: 30.0 GiB usable of 121.7 GiB (30.0 GiB available now, gpt-oss-120b holds " \
           "66.9 GiB (0.55 of it))" in r.why
    assert r.details["rooms"]["spark2"]["held"] == {"gpt-oss-120b": 0.55}
    for n in ns.values():
        assert writes(n) == [] and not [a for a in n.ran if a[:2] == ["systemctl", "start"]]
    bad = run_placement.run(dep, "glm-4.5-air-fp8", nodes="spark3")
    assert [r.why for r in bad] == ["--nodes: spark3: not a node with a GPU in the profile "
                                    "(nodes: spark1, spark2)"]
    moved = run_placement.run(dep, "gpt-oss-120b", nodes="spark1")
    assert [r.why for r in moved] == ["gpt-oss-120b is placed on spark2 already: serve.remove "
                                      "--recipe gpt-oss-120b first to move it"]


@pytest.fixture
def stop_before_staging(monkeypatch):
    """serve.add up to its decision: the staging says no, so nothing after it runs."""
    monkeypatch.setattr(run_placement, "staged", lambda ctx, new, name: "stopped here by the test")


def test_serve_add_places_where_it_fits_with_the_fraction_it_needs_and_free_ports(
        tmp_path, listed, monkeypatch, stop_before_staging):
    from sparkdeploy import lab
    from tests.unit.fakes import FakeClock, deployment
    from tests.unit.profiles import seed_data, write_profile
    from tests.unit.test_metrics import Ctx
    data = seed_data()
    data["sparkdeploy"]["recipes"] = [str(__import__("pathlib").Path(lab.__file__).parent / "recipes")]
    data["sparkdeploy"]["fit"] = {"reserve_gib": 3}
    path = write_profile(tmp_path, data)
    ns = cluster()
    dep = deployment(path, tmp_path / "state", Ctx(ns), clock=FakeClock())
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(60), "spark2": mem(90)})
    out = run_placement.run(dep, "lab-tiny-c")
    [fits, stopped] = out
    # spark1 holds no placed model (gpt-oss-120b is on spark2): tried first
    assert fits.status is Status.OK and fits.why.startswith(
        "lab-tiny-c (sparkdeploy-lab/tiny-qwen3-c) fits on spark1: TP=1 x PP=1 on 1 node(s) fits: "
        "3.0 GiB per node")  # the profile's reserve
    assert fits.why.endswith("<= 60.0 GiB usable; its engines may take 0.03 of each node's "
                             "memory; ports +2")  # +1 is gpt-oss-120b's
    assert fits.details["placement"] == {"of": BASE, "recipe": "lab-tiny-c", "nodes": ["spark1"],
                                         "offset": 2, "fraction": 0.03, "on_demand": False}
    assert (stopped.status, stopped.why) == (
        Status.FAILED, "lab-tiny-c: stopped here by the test; nothing that serves was touched")
    # a recipe's own fraction is kept, and refused when it asks more than the node gives
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(115), "spark2": mem(20)})
    out = run_placement.run(dep, "gpt-oss-20b", nodes="spark1")
    assert out[0].details["placement"]["fraction"] == 0.9 and "ports +2" in out[0].why
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(60), "spark2": mem(20)})
    [r] = run_placement.run(dep, "gpt-oss-20b", nodes="spark1")
    assert r.why.startswith("recipe gpt-oss-20b does not fit beside what the cluster serves: its "
                            "--gpu-memory-utilization 0.9 asks more than spark1 can give [spark1: "
                            "60.0 GiB usable of 121.7 GiB")


def test_serve_status_names_the_gateway_and_what_it_routes(tmp_path, listed, monkeypatch):
    ns = cluster()
    dep, _ = dep_of(tmp_path, ns)
    from sparkdeploy.steps import serve as serve_step
    monkeypatch.setattr(serve_step, "serving", lambda d, e: serve_step.Serving(e.name))
    assert not [r for r in run_one(dep, "serve.status") if "gateway" in r.why]  # none: not said
    ns["spark1"].node_files[UNIT_FILE] = "[Unit]\n"
    said = [r for r in run_one(dep, "serve.status") if "gateway" in r.why]
    assert [(r.status, r.why) for r in said] == [
        (Status.OK, f"gateway: http://192.168.1.11:8888 routes {BASE_REPO}, openai/gpt-oss-120b "
                    "(serve.list: where each serves)")]
    monkeypatch.setattr(sa.ep, "models", lambda url, deadline=5.0: [])
    assert [(r.status, r.why) for r in run_one(dep, "serve.status") if "gateway" in r.why] == [
        (Status.FAILED, f"gateway: http://192.168.1.11:8888 lists no model ({gw.UNIT} on spark1)")]


def test_the_gateway_routes_each_model_to_its_own_engine_whatever_the_listing_order(tmp_path, listed):
    ns = cluster()
    # a placed model's container listed first on the head, and the profile's own without a recipe
    ns["spark1"].containers.insert(0, EngineContainer(
        "sparkdeploy-glm-4-5-air-fp8-vllm-head",
        {**placed_labels(Placement(of=BASE, recipe="glm-4.5-air-fp8", nodes=["spark1"], offset=2)),
         labels.PORT: "8002"}, [4]))
    for c in ns["spark1"].containers[1:] + ns["spark2"].containers[:1]:
        c.labels.pop(labels.RECIPE)
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "serve.gateway")
    got = {b["models"][0]: b["url"] for b in json.loads(ns["spark1"].node_files[gw.CONFIG_FILE])["backends"]}
    assert got == {BASE_REPO: "http://127.0.0.1:8000", "zai-org/GLM-4.5-Air-FP8": "http://127.0.0.1:8002",
                   "openai/gpt-oss-120b": f"http://{ADDR['spark2']}:8001"}


def test_serve_add_takes_the_nodes_given_and_skips_every_port_in_use(tmp_path, listed, monkeypatch,
                                                                       stop_before_staging):
    ns = cluster()
    # another deployment's engine holds 8002: the offset skips it (gpt-oss-120b holds +1)
    ns["spark1"].containers.append(EngineContainer("other", {**own("head", "8002"),
                                                             labels.DEPLOYMENT: "other"}, [5]))
    dep, _ = dep_of(tmp_path, ns)
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(115), "spark2": mem(120)})
    # the nodes given are the only ones tried: spark2, where gpt-oss-120b holds 0.55
    [r] = run_placement.run(dep, "gpt-oss-20b", nodes="spark2")
    assert "its --gpu-memory-utilization 0.9 asks more than spark2 can give" in r.why
    out = run_placement.run(dep, "gpt-oss-20b")  # the fit alone: spark1, holding no placed model
    assert out[0].details["placement"] == {"of": BASE, "recipe": "gpt-oss-20b", "nodes": ["spark1"],
                                           "offset": 3, "fraction": 0.9, "on_demand": False}
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(20), "spark2": mem(30)})
    [r] = run_placement.run(dep, "glm-4.5-air-fp8")
    assert r.details["rooms"] == {
        "spark1": {"total": int(121.7 * GIB), "available": 20 * GIB, "usable": 20 * GIB, "held": {}},
        "spark2": {"total": int(121.7 * GIB), "available": 30 * GIB, "usable": 30 * GIB,
                   "held": {"gpt-oss-120b": 0.55}}}
    assert r.details["recipe"] == "glm-4.5-air-fp8"


def test_a_gateway_that_does_not_list_every_model_fails_on_time(tmp_path, monkeypatch):
    ns = cluster()
    dep, _ = dep_of(tmp_path, ns)
    monkeypatch.setattr(sa.ep, "models", lambda url, deadline=5.0: [BASE_REPO])
    [r] = run_one(dep, "serve.gateway")  # started, then not ready: one failed line
    assert (r.status, r.why) == (
        Status.FAILED, f"the gateway at http://192.168.1.11:8888 does not list {BASE_REPO}, "
        f"openai/gpt-oss-120b after 30 s: http://192.168.1.11:8888/v1/models lists {BASE_REPO}")
    assert dep.clock() >= 30


def test_the_profiles_own_model_is_the_one_its_containers_say(tmp_path, listed):
    ns = cluster()
    for n in ns.values():
        for c in n.containers:
            if c.labels[labels.DEPLOYMENT] == BASE:
                c.labels[labels.RECIPE] = "gpt-oss-20b"
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "serve.gateway")
    got = {b["models"][0]: b["url"] for b in json.loads(ns["spark1"].node_files[gw.CONFIG_FILE])["backends"]}
    assert got["openai/gpt-oss-20b"] == "http://127.0.0.1:8000" and BASE_REPO not in got


def test_nodes_given_are_read_in_the_profiles_order(tmp_path):
    ns = cluster()
    dep, _ = dep_of(tmp_path, ns)
    from sparkdeploy.steps.registry import StepContext
    ctx = StepContext("serve.add", dep.events, dep)
    assert sa.given_nodes(ctx, " spark2 , spark1") == ["spark1", "spark2"]
    assert sa.given_nodes(ctx, None) is None


def test_without_a_placed_model_a_dry_run_says_it_would_remove_the_gateway(tmp_path):
    ns = cluster(placed=False)
    ns["spark1"].node_files[UNIT_FILE] = "[Unit]\n"
    dep, _ = dep_of(tmp_path, ns, dry=True)
    assert [(r.status, r.why) for r in run_one(dep, "serve.gateway")] == [
        (Status.SKIPPED, f"would remove {gw.UNIT} on spark1")]
    assert UNIT_FILE in ns["spark1"].node_files


OD = Placement(of=BASE, recipe="gpt-oss-20b", nodes=["spark1"], offset=2, fraction=0.1, on_demand=True)
OD_UNIT = "sparkdeploy-gpt-oss-20b-vllm.service"


def registered(node: MetricsNode, placement: Placement = OD, port: int = 8002) -> None:
    """A model on demand's unit spec on the node, as serve.persist --idle writes it."""
    spec = {"unit": OD_UNIT, "canary": {"port": port, "model": "openai/gpt-oss-20b"},
            "stages": [{"containers": [{"run": [f"--label={labels.PLACEMENT}={placement.model_dump_json()}"]}]}]}
    node.node_files[f"{SERVE_DIR}/gpt-oss-20b-vllm.json"] = json.dumps(spec)


def test_serve_add_on_demand_goes_on_the_head_alone(tmp_path, listed, monkeypatch, stop_before_staging):
    from sparkdeploy import lab
    from tests.unit.fakes import FakeClock, deployment
    from tests.unit.profiles import seed_data, write_profile
    from tests.unit.test_metrics import Ctx
    data = seed_data()
    data["sparkdeploy"]["recipes"] = [str(__import__("pathlib").Path(lab.__file__).parent / "recipes")]
    data["sparkdeploy"]["fit"] = {"reserve_gib": 3}
    ns = cluster()
    dep = deployment(write_profile(tmp_path, data), tmp_path / "state", Ctx(ns), clock=FakeClock())
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(10), "spark2": mem(90)})
    # spark2 is roomier and holds gpt-oss-120b: the gateway on spark1 loads it, so spark1 it is
    [fits, stopped] = run_placement.run(dep, "lab-tiny-c", on_demand=True)
    assert fits.why.startswith("lab-tiny-c (sparkdeploy-lab/tiny-qwen3-c) fits on spark1, on demand "
                               "(the models on demand there take turns): TP=1 x PP=1")
    assert fits.details["placement"]["on_demand"] is True and fits.details["placement"]["nodes"] == ["spark1"]
    assert stopped.why == "lab-tiny-c: stopped here by the test; nothing that serves was touched"
    [r] = run_placement.run(dep, "lab-tiny-c", nodes="spark2", on_demand=True)
    assert (r.status, r.why) == (Status.FAILED, "--on-demand: a model on demand is loaded by the gateway "
                                                "on the head, spark1; not on spark2")
    # one on demand there, not loaded, frees nothing by its eviction: the node's 1 GiB is all
    ns["spark1"].node_files.clear()
    registered(ns["spark1"], OD.model_copy(update={"fraction": 0.5}))
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(1), "spark2": mem(90)})
    [r] = run_placement.run(dep, "lab-tiny-c", on_demand=True)[:1]
    assert r.status is Status.FAILED and ("1.0 GiB usable of 121.7 GiB (1.0 GiB available now, "
                                          "gpt-oss-20b holds 60.8 GiB (0.5 of it, on demand))") in r.why
    monkeypatch.setenv("SPARKDEPLOY_API_KEY", "sk-x")
    [r] = run_placement.run(dep, "lab-tiny-c", on_demand=True)
    assert r.why.startswith("--on-demand: SPARKDEPLOY_API_KEY is set")
    assert not [a for n in ns.values() for a in n.ran if a[:2] in (["systemctl", "start"], ["docker", "run"])]


@pytest.fixture
def with_on_demand(tmp_path, monkeypatch):
    """The cluster with gpt-oss-20b registered on demand on the head (spark1 121.7 GiB, 50 usable),
    the gateway listing every model."""
    ns = cluster()
    registered(ns["spark1"])
    dep, _ = dep_of(tmp_path, ns)
    monkeypatch.setattr(sa.ep, "models", lambda url, deadline=5.0: [BASE_REPO, "openai/gpt-oss-120b",
                                                                   "openai/gpt-oss-20b"])
    monkeypatch.setattr(sa, "node_memory", lambda ctx: {"spark1": mem(50), "spark2": mem(90)})
    return dep, ns


def test_the_gateway_is_told_each_model_on_demands_unit_and_memory(with_on_demand, monkeypatch):
    dep, ns = with_on_demand
    results = run_one(dep, "serve.gateway")
    assert [(r.status, r.why) for r in results] == [
        (Status.CHANGED, f"started {gw.UNIT} on spark1: {BASE_REPO}, openai/gpt-oss-120b, openai/gpt-oss-20b"),
        (Status.OK, "endpoint: http://192.168.1.11:8888")]
    total = int(121.7 * GIB)
    doc = json.loads(ns["spark1"].node_files[gw.CONFIG_FILE])
    assert doc["backends"][2] == {"url": "http://127.0.0.1:8002", "models": ["openai/gpt-oss-20b"],
                                  "on_demand": {"unit": OD_UNIT, "need_bytes": int(0.1 * total)}}
    # gpt-oss-120b is always loaded, on spark2: the head's whole room is theirs
    assert doc["on_demand"] == {"budget_bytes": int(total * 0.95), "wait_s": 60, "load_s": 900,
                                "record": gw.RECORD_FILE}
    assert "on_demand" not in doc["backends"][0] and "on_demand" not in doc["backends"][1]
    # gateway.on_demand_gib caps it
    dep.profile.gateway.__dict__["on_demand_gib"] = 20
    run_one(dep, "serve.gateway")
    assert json.loads(ns["spark1"].node_files[gw.CONFIG_FILE])["on_demand"]["budget_bytes"] == 20 * GIB
    # serve.status: each model on demand, loaded or not, with its loads and evictions
    ns["spark1"].node_files[gw.RECORD_FILE] = json.dumps([
        {"at": "2026-12-08T01:00:00Z", "event": "load", "model": "openai/gpt-oss-20b", "seconds": 31.2,
         "evicted": []},
        {"at": "2026-12-08T01:05:00Z", "event": "evict", "model": "openai/gpt-oss-20b", "for": "x/y",
         "why": "budget"}])
    from sparkdeploy.steps import serve as serve_step
    monkeypatch.setattr(serve_step, "serving", lambda d, e: serve_step.Serving(e.name))
    said = [r.why for r in run_one(dep, "serve.status") if "on demand" in r.why]
    assert said == [f"openai/gpt-oss-20b on demand ({OD_UNIT}): not loaded; 1 load(s), 1 eviction(s); "
                    "last load at 2026-12-08T01:00:00Z in 31.2 s; last evicted at 2026-12-08T01:05:00Z "
                    "for x/y"]
    # serve.list names it, not loaded; serve.remove takes it out with its unit
    listed = [r.details["placed"] for r in run_one(dep, "serve.list") if "placed" in r.details]
    assert listed[-1] == {"recipe": "gpt-oss-20b", "repo": "openai/gpt-oss-20b", "nodes": ["spark1"],
                          "url": "http://192.168.1.11:8002", "loaded": False, "engine": "gpt-oss-20b-vllm",
                          "deployment": f"{BASE}.gpt-oss-20b", "on_demand": True}


def test_a_model_on_demand_registered_already_is_left_as_it_is(with_on_demand):
    dep, ns = with_on_demand
    run_one(dep, "serve.gateway")
    for n in ns.values():
        n.ran.clear()
    out = run_placement.run(dep, "gpt-oss-20b", on_demand=True)
    assert [(r.step, r.status, r.why) for r in out] == [
        ("serve.add", Status.OK, "gpt-oss-20b is registered on demand on spark1, as placed"),
        ("serve.gateway", Status.OK, f"the gateway routes {BASE_REPO}, openai/gpt-oss-120b, "
                                     "openai/gpt-oss-20b, as it did"),
        ("serve.gateway", Status.OK, "endpoint: http://192.168.1.11:8888")]
    assert writes(ns["spark1"]) == [] and not [a for a in ns["spark1"].ran if a[:1] == ["systemctl"]
                                               and a[1] in ("start", "restart", "enable")]
    [r] = run_placement.run(dep, "gpt-oss-20b")
    assert (r.status, r.why) == (Status.FAILED, "gpt-oss-20b is placed on demand already: serve.remove "
                                                "--recipe gpt-oss-20b first to change it")
