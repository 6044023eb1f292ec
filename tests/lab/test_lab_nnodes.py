"""The lab with four nodes: each its own fast-link address and RoCE twins on one switch; the
pair's nodes untouched while spark3 and spark4 come and go, and nothing of them left after.

On the same four nodes (grown once for the module), deploy.all through the real `inv`: with
configs/lab-3nodes.yaml on three of them (pipeline parallel 3: `nox -s perf -- nnodes`, not the
suite), and with configs/lab-4nodes.yaml and `deploy.all --recipe
qwen3-235b-a22b-instruct-2507-fp8` (the 235B recipe, too big for two
Sparks: the model part from the recipe, the layout the fit calculator picks for four nodes,
TP=4; the lab hub serves the repository's real config.json and file layout). Each ends serving:
the weights verified on every node (its own records agree with the head's), the same image ID
on every node, one engine rank per node read from the labels `docker ps` shows there (ranks
0..N-1, the image ID each runs), the pipeline's stages in the ranks' own logs, and the endpoint
streams. Each takes its deployment down (serve.down; the head's units back).

The tests run in file order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from sparkdeploy.core.labels import parse_ps, ps_args
from sparkdeploy.core.wait import WaitTimeout, wait_for
from sparkdeploy.lab import layout, lifecycle, node, proc
from sparkdeploy.node import deployment
from sparkdeploy.profile.config import read_recipe
from tests.lab.conftest import lab_with
from tests.lab.test_deploy_lab import VERIFIED
from tests.lab.test_serve_lab import stream

pytestmark = pytest.mark.lab

EXTRA = ["spark3", "spark4"]


def _left(recs: list[dict]) -> list[str]:
    """Those of the recorded processes ``recs`` still in /proc (alive, or dead and not reaped
    yet), each with its state, parent and name; [] once every one has left. A PID held by a
    newer process (another start time) counts as left: PIDs wrap at 32768 here. Waits up to 30
    s for PID 1 to reap a daemon an earlier process started."""
    def still() -> list[str]:
        out = []
        for r in recs:
            if proc.start_time(r["pid"]) != r["start"]:
                continue
            try:
                stat = Path(f"/proc/{r['pid']}/stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            out.append(f"{r['pid']} {comm} state {state} parent {ppid}")
        return out
    try:
        wait_for(lambda: not still(), deadline=30, interval=0.1)
    except WaitTimeout:
        pass
    return still()


def _pair_view(nodes: list[str]) -> dict:
    """What must not change on the pair's nodes: their daemons' PIDs and their fast link."""
    st = lifecycle.lab_facts()["node"]
    out = {}
    for x in nodes:
        link = json.loads(subprocess.run(
            ["ip", "-j", "-n", layout.netns_name(x), "link", "show", layout.FAST_IF],
            capture_output=True, text=True, check=True).stdout)[0]
        out[x] = ({k: v["pid"] for k, v in st[x]["procs"].items()}, link["ifindex"],
                  link["address"])
    return out


@pytest.fixture(scope="module")
def lab4(lab):
    lifecycle.up(nodes=len(lab.nodes), flavor=layout.DEFAULT_DOCKERD)  # the pair, settled
    before = _pair_view(lab.nodes)
    with lab_with(lab, 4) as big:
        big.state["pair_before"] = before
        yield big


def test_four_nodes_each_their_own_fast_address_and_twins_on_one_switch(lab4):
    assert lab4.nodes == ["spark1", "spark2", "spark3", "spark4"]
    ports = json.loads(subprocess.run(["ip", "-j", "-n", layout.FAST_NETNS, "link", "show"],
                                      capture_output=True, text=True, check=True).stdout)
    assert sorted(p["ifname"] for p in ports if p.get("master") == layout.FAST_BRIDGE) == [
        "lab1f", "lab2f", "lab3f", "lab4f"]
    for i, x in enumerate(lab4.nodes, start=1):
        link = json.loads(lab4.ssh(x, ["ip", "-j", "-4", "addr", "show", layout.FAST_IF]).stdout)
        assert [(a["local"], a["prefixlen"]) for a in link[0]["addr_info"]] == [(f"10.77.1.{i}", 24)]
        assert link[0]["mtu"] == layout.FAST_MTU
        [mac] = json.loads(lab4.ssh(x, ["ip", "-j", "link", "show", layout.FAST_IF]).stdout)
        assert mac["address"] == layout.fast_mac(x)  # from the layout: the same on every lab.up
        assert lab4.ssh(x, ["ls", "/sys/class/infiniband"]).stdout.split() == sorted(
            layout.FAST_HCAS)
        netdevs = lab4.ssh(x, ["cat", *[f"/sys/class/infiniband/{h}/ports/1/gid_attrs/ndevs/0"
                                        for h in layout.FAST_HCAS]]).stdout.split()
        assert netdevs == [layout.FAST_IF] * 2


def test_every_node_reaches_every_other_over_the_fast_link_with_its_own_key(lab4):
    for x in lab4.nodes:
        others = [o for o in lab4.nodes if o != x]
        # the node's own ssh client, config and key; one line per peer: client, server
        script = "; ".join(f"ssh -o BatchMode=yes {o} 'echo $SSH_CONNECTION'" for o in others)
        seen = [line.split() for line in lab4.ssh(x, script).stdout.splitlines()]
        assert [(s[0], s[2]) for s in seen] == [(lab4.addr(x), lab4.addr(o)) for o in others]


def test_adding_nodes_left_the_pair_alone(lab4):
    assert _pair_view(["spark1", "spark2"]) == lab4.state["pair_before"]


# --- deploy.all on three and four of the four nodes (the lab grown once for both) ---------

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {3: "configs/lab-3nodes.yaml", 4: "configs/lab-4nodes.yaml"}
RECIPES = {4: "qwen3-235b-a22b-instruct-2507-fp8"}
"""The recipe ``deploy.all --recipe`` deploys on that many nodes (else the profile's model)."""
LAYOUTS = {3: (1, 3), 4: (4, 1)}
"""(TP, PP) of the engines: the profile's on three; the fit calculator's for the recipe on four
(64 attention heads and 4 KV heads divide by 4: tensor parallel first)."""
STAGES = {3: [(0, 0), (1, 0), (2, 0)], 4: [(0, 0), (0, 1), (0, 2), (0, 3)]}
"""(pipeline stage, tensor rank) of the node ranks, in order, as SGLang tags their log lines."""


def inv(n: int, state: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": PROFILES[n], "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    env.pop("SPARKDEPLOY_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def engine_containers(lab, node: str, name: str) -> list:
    """The deployment's engine containers on ``node``, as their labels there say."""
    return parse_ps(lab.ssh(node, ["docker", *ps_args(name)]).stdout)


def verified(lab, node: str, path: str) -> dict[str, int]:
    return json.loads(lab.ssh(node, ["python3", "-c", VERIFIED, path]).stdout)


def image_ids(lab, nodes: list[str], ref: str) -> dict[str, str]:
    return {x: lab.ssh(x, ["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                       check=False).stdout.strip() for x in nodes}


def check_serving(lab, n: int, state: Path, out: str) -> None:
    """What a finished deploy.all on ``n`` nodes must have left on them."""
    dep = deployment.load(ROOT / PROFILES[n], state, recipe=RECIPES.get(n))
    assert {(e.tensor_parallel, e.pipeline_parallel) for e in dep.profile.engines} == {LAYOUTS[n]}
    if n in RECIPES:
        assert dep.profile.model.repo == "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8"
        tp, pp, why = read_recipe(RECIPES[n]).layout(n)
        assert (tp, pp) == LAYOUTS[n] and why.startswith("the fit calculator"), why
    nodes = [x.name for x in dep.profile.nodes]
    assert nodes == layout.node_names(n) and set(nodes) <= set(lifecycle.lab_facts()["nodes"])
    last = out.strip().splitlines()[-2:]
    assert last[0].startswith("endpoint: http://") and last[1].startswith("record: "), last
    url, record = last[0].split(" ", 1)[1], Path(last[1].split(" ", 1)[1])
    data = json.loads(record.with_suffix(".json").read_text())["data"]
    assert data["engine"]["chosen"] == "sglang" and not data["engine"].get("tried"), data["engine"]
    assert {s["state"] for s in data["steps"].values()} <= {"done", "skipped"}, data["steps"]
    assert data["steps"]["model.precheck"]["state"] == data["steps"]["model.fit"]["state"] == "done"
    # the weights: every node's own records hold every file the head's do, same sizes
    weights = {x: verified(lab, x, dep.profile.model.path) for x in nodes}
    assert weights[nodes[0]] and all(w == weights[nodes[0]] for w in weights.values())
    # the image: one ID everywhere, the one the record names and every rank runs
    ids = image_ids(lab, nodes, data["image"]["tag"])
    assert set(ids.values()) == {data["image"]["id"]}, ids
    ranks = {}
    for x in nodes:
        [c] = engine_containers(lab, x, dep.profile.name)
        assert c.running and c.engine == "sglang" and c.image_id == data["image"]["id"], c
        ranks[x] = c.rank
    assert ranks == {x: i for i, x in enumerate(nodes)}
    # the ranks' own logs: each node one (pipeline, tensor) stage of the shape the profile asks
    seen = []
    for x in nodes:
        [c] = engine_containers(lab, x, dep.profile.name)
        cp = lab.ssh(x, ["docker", "logs", c.name])
        line = next(ln for ln in (cp.stdout + cp.stderr).splitlines() if "] world_size=" in ln)
        assert f"world_size={n} rank={ranks[x]} " in line, line
        m = re.match(r"\[[-0-9: ]+ (?:PP(\d+) )?TP(\d+)\]", line)  # SGLang: no PP tag at PP=1
        assert m, line
        seen.append((int(m[1] or 0), int(m[2])))
    assert sorted(seen) == STAGES[n]
    assert stream(url)
    models = requests.get(url.rstrip("/") + "/v1/models", timeout=10).json()
    assert dep.profile.model.repo in [m["id"] for m in models["data"]]


def deploy_on(lab, n: int, state: Path) -> None:
    started = time.monotonic()
    try:
        r = inv(n, state, "deploy.all", *(["--recipe", RECIPES[n]] if n in RECIPES else []))
        took = time.monotonic() - started
        print(f"\nnnodes.deploy_all_{n}_seconds: {took:.1f}")
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
        check_serving(lab, n, state, r.stdout)
    finally:
        down = inv(n, state, "serve.down")
        restore = inv(n, state, "services.restore")
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr
    assert restore.returncode == 0, restore.stdout[-2000:] + restore.stderr
    dep = deployment.load(ROOT / PROFILES[n], state, recipe=RECIPES.get(n))
    for x in layout.node_names(n):
        assert engine_containers(lab, x, dep.profile.name) == [], x


@pytest.mark.perf_lab  # `nox -s perf -- nnodes` (tools/perf/nnodes.py), not the suite
def test_three_nodes_pipeline_parallel_deploy_all_serves(lab4, tmp_path):
    deploy_on(lab4, 3, tmp_path / "state")  # spark1..spark3 of the four


def test_four_nodes_the_235b_recipe_deploy_all_serves_on_tp4(lab4, tmp_path):
    deploy_on(lab4, 4, tmp_path / "state")


def test_back_to_two_nodes_leaves_nothing_of_spark3_and_spark4(lab4, lab):
    recs = [p for x in EXTRA for p in lab4.state["node"][x]["procs"].values()]
    results = lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)
    assert not [r for r in results if r.failed]
    assert [(r.node, r.why) for r in results if r.step == "node" and r.node in EXTRA] == [
        (x, "removed (beyond --nodes)") for x in EXTRA]
    assert lifecycle.lab_facts()["nodes"] == ["spark1", "spark2"]
    assert _left(recs) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [x for x in EXTRA if layout.netns_name(x) in netns]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert "lab3m" not in links and "lab4m" not in links
    ports = subprocess.run(["ip", "-br", "-n", layout.FAST_NETNS, "link"], capture_output=True,
                           text=True).stdout.split("\n")
    assert sorted(p.split()[0].split("@")[0] for p in ports if p.strip()) == [
        "lab1f", "lab2f", "labfast0", "lo"]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not [x for x in EXTRA if f"/nodes/{x}/" in mounts or f"/ns/{x}.mnt" in mounts]
    assert not [x for x in EXTRA if layout.node_dir(x).exists() or layout.mntns_path(x).exists()]
    for x in EXTRA:  # and no process in what were their namespaces: none of them is there
        assert node.netns_exists(layout.netns_name(x)) is False
    ssh_config = layout.SSH_CONFIG.read_text()
    assert "spark3" not in ssh_config and "spark4" not in ssh_config
    assert "spark3" not in layout.KNOWN_HOSTS.read_text()
    # the pair as it was: same daemons, same links, and they reach each other
    assert _pair_view(["spark1", "spark2"]) == lab4.state["pair_before"]
    lab.ssh("spark1", ["ssh", "-o", "BatchMode=yes", "spark2", "true"])
    assert "spark3" not in lab.ssh("spark1", ["cat", "/root/.ssh/config"]).stdout


@pytest.mark.lab_last
def test_lab_down_leaves_nothing(lab):
    """Runs after every other lab test and leaves the lab down: lab.down leaves no process,
    namespace, link, mount or file of any node (the pair here; what a node beyond them leaves
    when it goes, the shrink from four nodes above checks). The next lab.up gives the nodes the
    same names, addresses and MACs: they follow from the layout, as the four-node test checks."""
    st = lifecycle.lab_facts()
    nodes = st["nodes"]
    assert nodes[:2] == ["spark1", "spark2"]
    recs = [p for x in nodes for p in st["node"][x]["procs"].values()]
    down = lifecycle.down()
    assert not [r for r in down if r.failed], down
    assert _left(recs) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in [*map(layout.netns_name, nodes), layout.FAST_NETNS] if n in netns]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert not [ln for ln in links.splitlines()
                if ln.split()[0].split("@")[0] in {layout.MGMT_BRIDGE, "lab1m", "lab2m", "lab3m",
                                                   "lab4m"}]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(layout.LAB_DIR) + "/" not in mounts
    assert not layout.LAB_DIR.exists()
