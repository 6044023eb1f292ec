"""Where ``serve.add`` places a model and the deployment it derives (``ops.placement``), and the
gateway's configuration (``ops.gateway``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sparkdeploy import lab
from sparkdeploy.core import labels
from sparkdeploy.lab import tiny
from sparkdeploy.model import fit
from sparkdeploy.ops import gateway as gw
from sparkdeploy.ops import placement as pl
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.profile.config import Placement, ProfileError, load_placed, load_profile
from tests.unit.fakes import deployment
from tests.unit.profiles import SEED, seed_data, write_profile

GIB = fit.GIB
LAB_RECIPES = Path(lab.__file__).parent / "recipes"


@pytest.fixture
def base_path(tmp_path):
    """The seed's profile with the lab's recipes beside the package's (lab-tiny-c names no
    memory fraction; the package's all do)."""
    data = seed_data()
    data["sparkdeploy"]["recipes"] = [str(LAB_RECIPES)]
    assert tiny.THIRD.recipe == "lab-tiny-c"
    return write_profile(tmp_path, data)


def test_a_placed_model_is_its_own_deployment_on_its_nodes_with_its_ports_moved(base_path):
    base = load_profile(base_path)
    p = pl.derive(base_path, base, Placement(of=base.name, recipe="lab-tiny-c", nodes=["spark2"],
                                             offset=3, fraction=0.42))
    assert p.name == "qwen3.5-122b-a10b-fp8.lab-tiny-c"
    assert [(n.name, n.role) for n in p.nodes] == [("spark2", "head")]
    [e] = p.engines
    assert (e.name, e.kind, e.port, e.dist_port) == ("lab-tiny-c-vllm", "vllm", 8003, 29504)
    assert (e.tensor_parallel, e.pipeline_parallel) == (1, 1)  # the recipe's layout for 1 node
    assert e.args == ["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
                      "--gpu-memory-utilization", "0.42"]
    assert p.serve.group_port == base.serve.group_port + 3
    assert p.model.repo == "sparkdeploy-lab/tiny-qwen3-c" and p.recipe == "lab-tiny-c"
    assert not p.metrics.enabled and p.endpoint is None
    assert p.placement is not None and p.placement.offset == 3
    assert p.services.stop == {}  # the owner's units are the profile's deployment's
    # its containers say so, for any controller to derive it again
    from sparkdeploy.engines import launch
    lau = launch(p, e, {})
    got = dict(lau.containers[0].labels)
    assert pl.read_label(got[labels.PLACEMENT]) == p.placement
    assert got[labels.DEPLOYMENT] == p.name and lau.containers[0].name == "sparkdeploy-lab-tiny-c-vllm-head"


def test_a_recipe_that_names_its_own_fraction_keeps_it(base_path):
    base = load_profile(base_path)
    p = pl.derive(base_path, base, Placement(of=base.name, recipe="gpt-oss-20b", nodes=["spark1"],
                                             offset=1, fraction=0.9))
    assert p.engines[0].args.count("--gpu-memory-utilization") == 1
    assert p.engines[0].name == "gpt-oss-20b-vllm"


def test_an_sglang_engine_gets_its_own_flag(base_path):
    base = load_profile(base_path)
    e = next(e for e in base.engines if e.kind == "sglang")
    assert pl.with_fraction(e.model_copy(update={"args": ["--x"]}), 0.333) == [
        "--x", "--mem-fraction-static", "0.33"]
    assert pl.with_fraction(e.model_copy(update={"args": ["--x"]}), None) == ["--x"]


def test_engine_names_are_safe_and_bounded():
    assert pl.engine_name("Qwen3.5-122B_a", "vllm") == "qwen3-5-122b-a-vllm"
    with pytest.raises(pl.PlacementError, match="longer than 63"):
        pl.engine_name("x" * 60, "vllm")


def test_a_port_moved_past_65535_is_refused(tmp_path):
    data = seed_data()
    data["sparkdeploy"]["recipes"] = [str(LAB_RECIPES)]
    data["sparkdeploy"]["serve"] = {"group_port": 65530}
    path = write_profile(tmp_path, data)
    base = load_profile(path)
    with pytest.raises(pl.PlacementError, match="serve.group_port 65530 \\+ the placement's offset 9 is past 65535"):
        pl.derive(path, base, Placement(of=base.name, recipe="lab-tiny-c", nodes=["spark1"], offset=9))


def test_a_profile_file_cannot_set_a_placement(tmp_path):
    data = seed_data()
    data["sparkdeploy"]["placement"] = {"of": "x", "recipe": "lab-tiny-c", "nodes": ["spark1"],
                                        "offset": 1}
    with pytest.raises(ProfileError, match="placement: set by serve.add on the nodes, not in a profile"):
        load_profile(write_profile(tmp_path, data))


# --- what the nodes hold -------------------------------------------------------------------------


def container(deployment: str, placement: Placement | None = None, port: int | None = 8001,
              state: str = "running") -> labels.Container:
    return labels.Container(id="c", name="n", state=state, status="Up", deployment=deployment,
                            engine="e", port=port,
                            placement=placement.model_dump_json() if placement else "")


def test_found_reads_the_models_placed_beside_this_deployment_only():
    a = Placement(of="base", recipe="a", nodes=["spark1"], offset=1, fraction=0.3)
    b = Placement(of="base", recipe="b", nodes=["spark1", "spark2"], offset=2, fraction=0.2)
    other = Placement(of="elsewhere", recipe="c", nodes=["spark1"], offset=1)
    listing = {
        "spark1": [container("base"), container("base.a", a), container("base.b", b),
                   container("elsewhere.c", other), container("base.x", a),  # a name it does not carry
                   labels.Container(id="z", name="z", state="running", status="", deployment="base.q",
                                    placement="{not json")],
        "spark2": [container("base.b", b, port=None, state="exited")],
    }
    got = pl.found("base", listing)
    assert [(f.deployment, f.placement.recipe, [n for n, _ in f.containers]) for f in got] == [
        ("base.a", "a", ["spark1"]), ("base.b", "b", ["spark1", "spark2"])]
    assert got[0].running and not got[1].running and got[1].port == 8001
    assert pl.held(got) == {"spark1": (pl.Held("a", 0.3), pl.Held("b", 0.2, loaded=False)),
                            "spark2": (pl.Held("b", 0.2, loaded=False),)}


def test_a_room_is_what_the_node_gives_now_and_what_the_claims_leave():
    r = pl.Room("spark1", total=100 * GIB, available=80 * GIB,
                held=(pl.Held("a", 0.3), pl.Held("b", 0.2)))
    assert r.claimed == 50 * GIB
    assert r.usable == 45 * GIB  # 95 % of the total less the claims, under what is available
    assert pl.Room("s", 100 * GIB, 30 * GIB).usable == 30 * GIB
    assert pl.Room("s", 100 * GIB, 80 * GIB, (pl.Held("a", 0.99),)).usable == 0
    assert r.line() == ("spark1: 45.0 GiB usable of 100.0 GiB (80.0 GiB available now, a holds "
                        "30.0 GiB (0.3 of it), b holds 20.0 GiB (0.2 of it))")


def rooms(**usable_gib: float) -> dict[str, pl.Room]:
    return {n: pl.Room(n, int(121.7 * GIB), int(g * GIB)) for n, g in usable_gib.items()}


def recipe(name: str) -> rcp.Recipe:
    return rcp.read(name, rcp.directories(), "--recipe")


def test_one_node_before_two_and_the_roomiest_first():
    got = pl.choose(recipe("gpt-oss-120b"), rooms(spark1=80, spark2=100), None, 8.0)
    assert isinstance(got, pl.Choice)
    assert got.nodes == ("spark2",) and got.estimate.nodes == 1
    # the fraction is what the estimate needs of the node's total, rounded up to a hundredth
    assert got.fraction == pytest.approx(
        -(-got.estimate.worst.need * 100 // (121.7 * GIB)) / 100)
    assert pl.candidates(rooms(a=1, b=3, c=2), None) == [
        ("b",), ("c",), ("a",), ("b", "c"), ("a", "b"), ("a", "c"), ("a", "b", "c")]


def test_a_model_too_big_for_one_node_goes_across_two():
    got = pl.choose(recipe("qwen3.5-122b-a10b-fp8"), rooms(spark1=110, spark2=110), None, 8.0)
    assert isinstance(got, pl.Choice) and got.nodes == ("spark1", "spark2")
    assert got.estimate.tp * got.estimate.pp == 2


def test_the_nodes_given_are_the_only_ones_tried():
    got = pl.choose(recipe("gpt-oss-120b"), rooms(spark1=20, spark2=100), ["spark1"], 8.0)
    assert isinstance(got, list) and len(got) == 1
    assert got[0].startswith("on spark1: TP=1 x PP=1 on 1 node(s) does not fit: ")
    assert got[0].endswith("> 20.0 GiB usable")


def test_nowhere_is_a_refusal_with_every_layouts_and_nodes_numbers():
    room = {"spark1": pl.Room("spark1", int(121.7 * GIB), int(40 * GIB), (pl.Held("lab-tiny-b", 0.5),)),
            "spark2": pl.Room("spark2", int(121.7 * GIB), int(30 * GIB))}
    why = pl.choose(recipe("qwen3.5-122b-a10b-fp8"), room, None, 8.0)
    # spark2 holds no placed model: tried first
    assert isinstance(why, list) and [w.split(":")[0] for w in why] == ["on spark2", "on spark1, spark2"]
    line = pl.refusal("qwen3.5-122b-a10b-fp8", why, room)
    assert line.startswith("recipe qwen3.5-122b-a10b-fp8 does not fit beside what the cluster serves: on ")
    assert "spark1: 40.0 GiB usable of 121.7 GiB (40.0 GiB available now, lab-tiny-b holds 60.8 GiB" in line
    assert "spark2: 30.0 GiB usable of 121.7 GiB (30.0 GiB available now)" in line
    assert line == (f"recipe qwen3.5-122b-a10b-fp8 does not fit beside what the cluster serves: "
                    f"{why[0]}; {why[1]} [{room['spark1'].line()}; {room['spark2'].line()}]")


def test_the_offset_skips_what_other_models_and_ports_use(base_path):
    base = load_profile(base_path)
    engines = list(load_placed(base_path, "lab-tiny-c", ["spark1"]).engines)
    taken = pl.profile_ports(base)
    assert {8000, 30000, 29990, 8888, 9090, 9408, 9480} <= taken
    assert {e.dist_port for e in base.engines if e.dist_port is not None} <= taken  # init ports
    assert pl.offset(taken, set(), engines, 29990) == 1
    assert pl.offset(taken, {1, 2}, engines, 29990) == 3
    assert pl.offset(taken | {8001, 8002}, set(), engines, 29990) == 3  # an engine's API port there
    assert pl.offset(taken | {29502}, set(), engines, 29990) == 2       # a dist port
    with pytest.raises(pl.PlacementError, match="no port offset"):
        pl.offset(set(range(8001, 9002)), set(), engines, 29990)


# --- the gateway ------------------------------------------------------------------------------------


def test_the_gateway_config_holds_the_keys_digest_never_the_key(tmp_path):
    dep = deployment(SEED, tmp_path / "state")
    backends = [gw.Backend("m/a", "http://127.0.0.1:8001", "d.a"),
                gw.Backend("m/b", "http://spark2:8002", "d.b")]
    text = gw.config_json(dep, backends, "s3cret-key")
    assert "s3cret-key" not in text
    assert json.loads(text) == {
        "listen": "0.0.0.0:8888",
        "backends": [{"url": "http://127.0.0.1:8001", "models": ["m/a"]},
                     {"url": "http://spark2:8002", "models": ["m/b"]}],
        "api_key_sha256": hashlib.sha256(b"s3cret-key").hexdigest()}
    assert "api_key_sha256" not in json.loads(gw.config_json(dep, backends, None))
    assert gw.start_argv() == ["/usr/bin/python3", "-B", "/var/lib/sparkdeploy-node/gateway/gateway.py",
                               "--config=/var/lib/sparkdeploy-node/gateway/config.json"]
    assert gw.backend_url(dep, "spark1", 8001) == "http://127.0.0.1:8001"
    assert gw.backend_url(dep, "spark2", 8002).endswith(":8002")


def test_the_recipe_is_found_where_the_profile_looks_with_its_own_reserve_and_no_endpoint(tmp_path):
    data = seed_data()  # no lab recipes in the file: given beside it (--recipes), as base.recipes
    data["sparkdeploy"]["fit"] = {"engines": {"vllm": 5.0}}
    data["sparkdeploy"]["endpoint"] = "http://spark1:8000"
    path = write_profile(tmp_path, data)
    base = load_profile(path, recipe_dirs=(str(LAB_RECIPES),))
    p = pl.derive(path, base, Placement(of=base.name, recipe="lab-tiny-c", nodes=["spark1", "spark2"],
                                        offset=1, fraction=0.1))
    assert p.model.repo == "sparkdeploy-lab/tiny-qwen3-c" and p.endpoint is None
    assert p.fit.engines == {"lab-tiny-c-vllm": 5.0}
    assert [(n.name, n.role) for n in p.nodes] == [("spark1", "head"), ("spark2", "worker")]
    assert p.engines[0].tensor_parallel == 2  # the recipe's layout for two nodes


def test_an_engine_without_an_init_port_keeps_none(base_path, monkeypatch):
    base = load_profile(base_path)
    real = pl.load_placed

    def no_dist(*a, **kw):
        p = real(*a, **kw)
        return p.model_copy(update={"engines": [e.model_copy(update={"dist_port": None}) for e in p.engines]})

    monkeypatch.setattr(pl, "load_placed", no_dist)
    p = pl.derive(base_path, base, Placement(of=base.name, recipe="lab-tiny-c", nodes=["spark1"], offset=2))
    assert (p.engines[0].port, p.engines[0].dist_port) == (8002, None)


def test_a_placed_models_deployment_shares_the_profiles_state_stream_and_clocks(base_path, tmp_path):
    from tests.unit.fakes import FakeClock
    base = deployment(base_path, tmp_path / "state", dry=True, clock=FakeClock())
    d = pl.deployment(base, Placement(of=base.profile.name, recipe="lab-tiny-c", nodes=["spark2"], offset=1))
    assert (d.profile_path, d.state, d.events, d.dry) == (base.profile_path, base.state, base.events, True)
    assert (d.clock, d.sleep, d.wall) == (base.clock, base.sleep, base.wall)
    assert list(d.hosts) == ["spark2"] and d.hosts["spark2"].state is base.state
    assert d.hosts["spark2"].node.role == "head"


def test_the_calculator_gets_the_recipes_context_layout_and_the_reserve():
    r = recipe("qwen3.5-122b-a10b-fp8")
    e = pl.sized(r, 2, int(100 * GIB), 3.0)
    assert e.reserve.value == 3 * GIB and e.context.value == r.context
    assert e.tp == r.stated(2)["tp"] and e.weights.source == r.about["weights"]["source"]
    assert e.usable.source == "room beside the placed models" and e.worst.usable == 100 * GIB


def test_the_reserve_decides_and_the_fraction_is_rounded_up_to_a_hundredth():
    r = recipe("gpt-oss-120b")
    need3 = pl.sized(r, 1, int(100 * GIB), 3.0).worst.need
    need8 = pl.sized(r, 1, int(100 * GIB), 8.0).worst.need
    assert need8 - need3 == 5 * GIB
    room = {"a": pl.Room("a", int(need3 / 0.496), int(need3 / 0.496))}
    got = pl.choose(r, room, None, 3.0)
    assert isinstance(got, pl.Choice) and got.fraction == 0.5  # 49.6 % -> 0.50


def test_a_size_the_calculator_refuses_is_passed_for_the_next(monkeypatch):
    real = pl.sized

    def one_node_refused(recipe_, nodes, usable, reserve):
        if nodes == 1:
            raise pl.est.EstimateError("no layout on one node")
        return real(recipe_, nodes, usable, reserve)

    monkeypatch.setattr(pl, "sized", one_node_refused)
    got = pl.choose(recipe("gpt-oss-120b"), rooms(a=100, b=100), None, 3.0)
    assert isinstance(got, pl.Choice) and got.nodes == ("a", "b")
    monkeypatch.setattr(pl, "sized", lambda *a: (_ for _ in ()).throw(pl.est.EstimateError("no")))
    assert pl.choose(recipe("gpt-oss-120b"), rooms(a=1, b=1), None, 3.0) == [
        "on 1 node(s): no", "on 2 node(s): no"]


def test_offset_bounds(base_path):
    engines = list(load_placed(base_path, "lab-tiny-c", ["spark1"]).engines)
    # the group port alone taken at +1
    assert pl.offset({29991}, set(), engines, 29990) == 2
    # the top port is 65535 itself: allowed
    assert pl.offset(set(), set(), engines, 65534) == 1
    with pytest.raises(pl.PlacementError):
        pl.offset(set(), set(), engines, 65535)
    # every offset up to MAX_OFFSET is tried, the last one too
    assert pl.offset(set(), set(range(1, pl.MAX_OFFSET)), engines, 29990) == pl.MAX_OFFSET


def test_an_engine_name_of_exactly_63_characters_is_kept_and_dashes_are_trimmed():
    assert pl.engine_name("x" * 58, "vllm") == "x" * 58 + "-vllm"
    with pytest.raises(pl.PlacementError):
        pl.engine_name("x" * 59, "vllm")  # 64
    assert pl.engine_name("-.a.-", "vllm") == "a-vllm"


def test_a_persisted_units_spec_names_its_placement_even_with_no_container_running():
    pl_ = Placement(of="base", recipe="lab-tiny-c", nodes=["spark2"], offset=2, fraction=0.13)
    spec = {"stages": [{"containers": [{"run": ["--label=org.sparkdeploy.deployment=base.lab-tiny-c",
                                                f"--label={labels.PLACEMENT}={pl_.model_dump_json()}"]}]}]}
    assert pl.from_spec(json.dumps(spec), "base") == pl.Registered(pl_, "", None, None)
    spec.update(unit="sparkdeploy-lab-tiny-c-vllm.service", canary={"port": 8002, "model": "m"})
    assert pl.from_spec(json.dumps(spec), "base", "spark2") == pl.Registered(
        pl_, "spark2", "sparkdeploy-lab-tiny-c-vllm.service", 8002)
    assert pl.from_spec(json.dumps(spec), "other") is None
    assert pl.from_spec(json.dumps({"stages": [{"containers": [{"run": ["--rm"]}]}]}), "base") is None
    assert pl.from_spec("{not json", "base") is None and pl.from_spec("[]", "base") is None
    assert pl.from_spec(json.dumps({"stages": ["x", {"containers": ["y", {"run": None}]}]}), "base") is None

    class Host:
        name = "spark2"

        def run(self, argv, change=True, sudo=False):
            assert argv[-1] == pl.SPECS and sudo and not change
            out = "".join(f"{pl.SPECS}/{n}.json\n{t}\n#end\n" for n, t in (
                ("vllm", json.dumps({"stages": []})), ("lab-tiny-c-vllm", json.dumps(spec))))
            return type("R", (), {"stdout": out})()

    assert pl.units_of(Host(), "base") == [
        pl.Registered(pl_, "spark2", "sparkdeploy-lab-tiny-c-vllm.service", 8002)]


def test_models_on_demand_take_turns_in_a_nodes_room():
    always, od_loaded, od_idle = (pl.Held("a", 0.3), pl.Held("b", 0.2, on_demand=True),
                                  pl.Held("c", 0.25, on_demand=True, loaded=False))
    # a model always loaded leaves room for the largest model on demand, not for all of them
    r = pl.Room("s", 100 * GIB, 40 * GIB, (always, od_loaded, od_idle))
    assert r.claimed == 55 * GIB and r.evictable == 20 * GIB
    assert r.usable == 40 * GIB  # under what the node gives now
    assert pl.Room("s", 100 * GIB, 90 * GIB, (always, od_loaded, od_idle)).usable == 40 * GIB
    # a model on demand: the others on demand count for nothing, and the loaded ones' memory is
    # the gateway's to free
    e = pl.Room("s", 100 * GIB, 40 * GIB, (always, od_loaded, od_idle), evicting=True)
    assert e.claimed == 30 * GIB and e.usable == 60 * GIB
    assert pl.Room("s", 100 * GIB, 90 * GIB, (always, od_loaded), evicting=True).usable == 65 * GIB
    assert pl.Room("s", 100 * GIB, 40 * GIB, (always,), evicting=True).usable == 40 * GIB
    assert r.line() == ("s: 40.0 GiB usable of 100.0 GiB (40.0 GiB available now, a holds 30.0 GiB "
                        "(0.3 of it), b holds 20.0 GiB (0.2 of it, on demand, loaded), c holds "
                        "25.0 GiB (0.25 of it, on demand))")


def test_a_model_found_by_its_unit_alone_is_placed_on_its_nodes_not_loaded():
    a = Placement(of="base", recipe="a", nodes=["spark1"], offset=1, fraction=0.3)
    b = Placement(of="base", recipe="b", nodes=["spark1"], offset=2, fraction=0.2, on_demand=True)
    c = Placement(of="base", recipe="c", nodes=["spark1", "spark2"], offset=3, fraction=0.1)
    found = pl.found("base", {"spark1": [container("base.a", a)]})
    units = [pl.Registered(c, "spark2", "sparkdeploy-c-vllm.service", None),
             pl.Registered(a, "spark1", "sparkdeploy-a-vllm.service", 8001),
             pl.Registered(b, "spark1", "sparkdeploy-b-vllm.service", 8002),
             pl.Registered(c, "spark1", "sparkdeploy-c-vllm.service", 8003)]
    got = pl.with_units(found, units)
    assert [(f.deployment, bool(f.containers), f.unit) for f in got] == [
        ("base.a", True, units[1]), ("base.c", False, units[3]), ("base.b", False, units[2])]
    assert got[0].loaded and not got[1].loaded and not got[2].loaded
    assert pl.held(got) == {"spark1": (pl.Held("a", 0.3), pl.Held("c", 0.1, loaded=False),
                                       pl.Held("b", 0.2, on_demand=True, loaded=False)),
                            "spark2": (pl.Held("c", 0.1, loaded=False),)}
    # a unit on another node only: that one
    assert pl.with_units([], units[:1])[0].unit == units[0]


def test_what_a_spec_or_a_placement_does_not_say_is_left_out():
    pl_ = Placement(of="base", recipe="a", nodes=["spark1"], offset=1, fraction=0.2, on_demand=True)
    spec = {"unit": 5, "canary": {"port": "8001"},
            "stages": [{"containers": [{"run": [f"--label={labels.PLACEMENT}={pl_.model_dump_json()}"]}]}]}
    assert pl.from_spec(json.dumps(spec), "base", "spark1") == pl.Registered(pl_, "spark1", None, None)
    # found by its containers alone: no unit
    found = pl.found("base", {"spark1": [container("base.a", pl_)]})
    assert [f.unit for f in pl.with_units(found, [])] == [None]
    # a placement with no fraction of its own claims nothing; the next one still counts
    own = Placement(of="base", recipe="o", nodes=["spark1"], offset=2)
    got = pl.with_units([], [pl.Registered(own, "spark1", "u1", 1), pl.Registered(pl_, "spark1", "u2", 2)])
    assert pl.held(got) == {"spark1": (pl.Held("a", 0.2, on_demand=True, loaded=False),)}
