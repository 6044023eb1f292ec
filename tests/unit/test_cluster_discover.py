"""``inv cluster.discover`` on Sparks as real ones show themselves (``data/spark``,
``data/memory``: recorded ``ibdev2netdev``, PCI twins, the GB10's ``[N/A]`` nvidia-smi, its
``/proc/meminfo``, ``docker info``), through the task, with the node helper running unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from invoke.exceptions import Exit

from sparkdeploy.profile.config import load_profile
from sparkdeploy.tasks.cluster import discover
from tests.unit.cluster_fakes import ClusterContext, helper_args, spark_pair
from tests.unit.profiles import ROOT

PASSWORD = "sudo: a terminal is required to read the password; either use the -S option to read " \
           "from standard input or configure an askpass helper\nsudo: a password is required"


def run(tmp_path, monkeypatch, nodes, capsys, *, dry=False, **flags):
    ctx = ClusterContext(nodes, monkeypatch, dry=dry)
    code = 0
    try:
        discover(ctx, nodes=flags.pop("aliases", ",".join(nodes)), **flags)
    except Exit as e:
        code = e.code
    out = capsys.readouterr().out
    return ctx, code, out


def nodes_of(path: Path) -> list[dict]:
    return [n.model_dump() for n in load_profile(path).nodes]


def test_a_pair_cabled_in_the_outer_port_gives_a_profile_that_validates(tmp_path, monkeypatch, capsys):
    target = tmp_path / "mine.yaml"
    ctx, code, out = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys, write=str(target))
    assert code == 0, out
    link = {"interface": "enp1s0f1np1", "hcas": ["rocep1s0f1", "roceP2p1s0f1"]}
    assert nodes_of(target) == [
        {"name": "spark1", "role": "head", "ssh": "spark1",
         "link": {**link, "address": "192.168.177.11"}, "gpus": 1,
         "docker_socket": "/var/run/docker.sock", "privilege": "sudo", "arch": "arm64"},
        {"name": "spark2", "role": "worker", "ssh": "spark2",
         "link": {**link, "address": "192.168.177.12"}, "gpus": 1,
         "docker_socket": "/var/run/docker.sock", "privilege": "sudo", "arch": "arm64"}]
    # one read per node, then the head asks whether the peer's address answers
    assert helper_args(ctx, "spark2")[0][0] == "facts"
    assert helper_args(ctx, "spark1")[-1] == ["answers", "--from", "192.168.177.11", "192.168.177.12"]
    assert len(helper_args(ctx, "spark2")) == 1
    text = target.read_text()
    # only what was discovered, each value with where it was read
    assert set(yaml.safe_load(text)) == {"extends", "sparkdeploy"}
    assert set(yaml.safe_load(text)["sparkdeploy"]) == {"nodes"}
    value_lines = [ln for ln in text.splitlines() if re.match(r"^\s+[a-z_-]+( [a-z_]+)?: \S", ln)]
    assert value_lines and all("   # " in ln for ln in value_lines), text
    assert "hcas: [rocep1s0f1, roceP2p1s0f1]   # /sys/class/infiniband" in text
    assert "gpus: 1   # nvidia-smi: NVIDIA GB10" in text
    assert "arch: arm64   # uname -m: aarch64" in text
    assert "privilege: sudo   # sudo -n true works for owner" in text
    # what was found, and the twin up without an address, are results
    assert re.search(r"ok +cluster\.discover +spark1 +arm64 \(uname -m: aarch64\); 1 GPU\(s\): "
                     r"NVIDIA GB10; memory: 1 x NVIDIA GB10: 113\.1 GiB of 121\.7 GiB usable", out)
    assert re.search(r"Docker 28\.5\.1 at /var/run/docker\.sock \(the default socket\): image store "
                     r"classic \(overlay2\), runtimes io\.containerd\.runc\.v2, nvidia, runc", out)
    assert "warning: enP2p1s0f1np1 is up without an IPv4 address (a twin of the link's port)" in out
    assert re.search(r"changed +cluster\.discover +- +wrote .*mine\.yaml \(validated\)", out)


def test_the_written_profile_extends_the_seed_by_name_beside_it(tmp_path, monkeypatch, capsys):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "qwen3.5-122b-a10b-fp8.yaml").symlink_to(ROOT / "configs" / "qwen3.5-122b-a10b-fp8.yaml")
    _, code, _ = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys,
                     write=str(configs / "mine.yaml"))
    assert code == 0
    assert yaml.safe_load((configs / "mine.yaml").read_text())["extends"] == "qwen3.5-122b-a10b-fp8.yaml"
    _, again, out = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys,
                        write=str(configs / "mine.yaml"))
    assert again == 0 and "already holds this profile" in out


def test_without_write_the_profile_is_printed_and_validates(tmp_path, monkeypatch, capsys):
    _, code, out = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys)
    assert code == 0
    text = out[out.index("# Written by `inv cluster.discover --nodes spark1,spark2`"):]
    (tmp_path / "printed.yaml").write_text(text)
    assert [n["link"]["address"] for n in nodes_of(tmp_path / "printed.yaml")] == [
        "192.168.177.11", "192.168.177.12"]


def test_nodes_not_named_as_the_seeds_drop_the_seeds_units(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    nodes = {"owner@Spark-A.local": pair["spark1"], "sparkb": pair["spark2"]}
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, nodes, capsys, write=str(target))
    assert code == 0, out
    p = load_profile(target)
    assert [(n.name, n.ssh) for n in p.nodes] == [("spark-a-local", "owner@Spark-A.local"),
                                                  ("sparkb", "sparkb")]
    assert p.services.stop == {}


def test_both_ports_cabled_with_an_address_each_is_ambiguous_until_chosen(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path, "ibdev2netdev-leadtek.txt")
    for i, node in enumerate(pair.values()):
        node.view.ifaces["enP2p1s0f1np1"].ipv4 = [f"10.0.1.{1 + i}/24"]
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 1 and not target.exists()
    line = next(ln for ln in out.splitlines() if "ambiguous" in ln)
    assert ("2 candidate links, which one is ambiguous: 192.168.177.0/24 (spark1 enp1s0f0np0 "
            "192.168.177.11/24, spark2 enp1s0f0np0 192.168.177.12/24); 10.0.1.0/24 (spark1 "
            "enP2p1s0f1np1 10.0.1.1/24, spark2 enP2p1s0f1np1 10.0.1.2/24) (choose with --interface)") in line
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target),
                       interface="enP2p1s0f1np1")
    assert code == 0, out
    assert [n["link"]["hcas"] for n in nodes_of(target)] == [["rocep1s0f1", "roceP2p1s0f1"]] * 2


def test_two_candidates_of_one_node_in_one_subnet_are_refused(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path, "ibdev2netdev-leadtek.txt")
    pair["spark1"].view.ifaces["enP2p1s0f0np0"].ipv4 = ["192.168.177.21/24"]
    _, code, out = run(tmp_path, monkeypatch, pair, capsys)
    assert code == 1
    assert ("spark1 has 2 RDMA-backed interfaces in 192.168.177.0/24 (enp1s0f0np0, enP2p1s0f0np0): "
            "which one is the link is ambiguous") in out


def test_no_shared_subnet_lists_every_candidate(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].view.ifaces["enp1s0f1np1"].ipv4 = ["192.168.178.12/24"]
    _, code, out = run(tmp_path, monkeypatch, pair, capsys)
    assert code == 1
    assert ("no subnet that every node reaches on an RDMA-backed interface that is up with an "
            "IPv4 address: spark1: enp1s0f0np0 down no IPv4; enp1s0f1np1 up 192.168.177.11/24; ") in out


def test_a_peer_that_does_not_answer_on_the_link_is_no_link(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].cabled = False
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 1 and not target.exists()
    assert ("no peer answers the head on the link: 192.168.177.0/24 (spark1 enp1s0f1np1 "
            "192.168.177.11/24, spark2 enp1s0f1np1 192.168.177.12/24): spark2 192.168.177.12: "
            "no answer in 3s") in out


def test_mtu_below_jumbo_and_a_twin_down_are_warnings(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].view.ifaces["enp1s0f1np1"].mtu = 1500
    pair["spark2"].view.hca_state["roceP2p1s0f1"] = "1: DOWN"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(tmp_path / "mine.yaml"))
    assert code == 0
    warnings = [ln.split("warning: ")[1] for ln in out.splitlines() if " spark2 " in ln and "warning:" in ln]
    assert warnings == [
        "enp1s0f1np1 has MTU 1500, below 9000 (jumbo frames on both ends)",
        "enP2p1s0f1np1 is up without an IPv4 address (a twin of the link's port)",
        "roceP2p1s0f1 is DOWN while its twin rocep1s0f1 is ACTIVE (one twin carries about half "
        "the bandwidth)"]


def test_an_unknown_host_key_says_to_run_hosts_trust(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].host_key_known = False
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host spark1 spark2\n")
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, ssh_config=str(cfg), write=str(target))
    assert code == 1 and not target.exists()
    assert re.search(rf"failed +cluster\.discover +spark2 +its host key is not known here: run "
                     rf"`inv hosts\.trust --nodes spark1,spark2 --ssh-config {cfg}` first$", out, re.M)


def test_a_node_that_does_not_answer_or_has_no_python3_is_one_line_each(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark1"].python3 = False
    pair["spark2"].reachable = False
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 1 and not target.exists()
    assert re.search(r"failed +cluster\.discover +spark1 +python3 is not installed \(sparkdeploy's "
                     r"node helpers need it\)$", out, re.M)
    assert re.search(r"failed +cluster\.discover +spark2 +unreachable: ssh: connect to host spark2 "
                     r"port 22: No route to host$", out, re.M)
    assert re.search(r"failed +cluster\.discover +- +not every node could be read: no profile$", out, re.M)


def test_sudo_that_asks_for_a_password_is_said_plainly(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].sudo = (1, PASSWORD)
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 1
    assert re.search(r"failed +cluster\.discover +spark2 +sudo asks owner for a password: "
                     r"deployments need it without one \(a NOPASSWD rule for owner\) or root", out)
    assert [n["privilege"] for n in nodes_of(target)] == ["sudo", "sudo"]


def test_root_a_docker_host_socket_and_the_containerd_store(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    for node in pair.values():
        node.uid = 0
        node.env = {"DOCKER_HOST": "unix:///srv/docker/docker.sock"}
        node.docker_info = node.docker_info.replace(
            '"DriverStatus": [', '"DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"], ')
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 0
    assert {(n["privilege"], n["docker_socket"]) for n in nodes_of(target)} == {
        ("none", "/srv/docker/docker.sock")}
    assert "($DOCKER_HOST of the SSH session): image store containerd" in out


def test_missing_rsync_and_no_gpu_fail_the_node(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].tools["rsync"] = None
    _, code, out = run(tmp_path, monkeypatch, pair, capsys)
    assert code == 1
    assert "rsync is not installed (model.sync copies the weights with it)" in out


def test_a_profile_the_loader_refuses_is_not_written(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].gpus = 52  # 53 GPUs: a prime above 48 layers: no layout for them
    target = tmp_path / "mine.yaml"
    _, code, out = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 1 and not target.exists()
    assert re.search(r"the discovered profile does not validate: .*recipe qwen3\.5-122b-a10b-fp8: "
                     r"no layout for 53 node\(s\)", out)


def test_three_gpus_get_the_recipes_layout_pipeline_parallel_3(tmp_path, monkeypatch, capsys):
    pair = spark_pair(tmp_path)
    pair["spark2"].gpus = 2  # 3 GPUs: Qwen3.5's 32 heads do not divide by 3, so PP=3
    target = tmp_path / "mine.yaml"
    _, code, _ = run(tmp_path, monkeypatch, pair, capsys, write=str(target))
    assert code == 0
    p = load_profile(target)
    assert [(e.tensor_parallel, e.pipeline_parallel) for e in p.engines] == [(1, 3)] * 3


def test_dry_run_reads_but_only_says_it_would_write(tmp_path, monkeypatch, capsys):
    target = tmp_path / "mine.yaml"
    ctx, code, out = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys, dry=True,
                         write=str(target))
    assert code == 0 and not target.exists()
    assert re.search(rf"skipped +cluster\.discover +- +would write {target}$", out, re.M)
    assert helper_args(ctx, "spark1")[0][0] == "facts"


@pytest.mark.parametrize("flags, line", [
    ({}, "--nodes: required: ALIAS[,ALIAS...] (ssh aliases; the first is the head)"),
    ({"aliases": "spark1,,spark2"}, "--nodes: an empty name in 'spark1,,spark2' (NAME[,NAME...])"),
    ({"aliases": "-oProxyCommand=x"}, "--nodes: '-oProxyCommand=x' starts with '-' (ssh would read it as an option)"),
    ({"aliases": "spark1,root@spark1"}, "--nodes: 'root@spark1' names the node 'spark1' twice"),
    ({"aliases": "spark1", "ssh_config": "/nonexistent/ssh_config"},
     "--ssh-config: /nonexistent/ssh_config: no such file"),
    ({"aliases": "spark1", "write": "/nonexistent/dir/mine.yaml"},
     "--write: directory /nonexistent/dir does not exist (create it first)"),
    ({"aliases": "spark1", "interface": "en p1"}, "--interface: 'en p1' is not an interface name"),
])
def test_every_flag_is_a_door(tmp_path, flags, line):
    ctx = ClusterContext({}, None)
    with pytest.raises(Exit) as e:
        discover(ctx, nodes=flags.pop("aliases", None), **flags)
    assert (e.value.code, str(e.value.message)) == (2, line)
    assert ctx.calls == []


def test_recipe_flag_writes_a_profile_that_says_recipe(tmp_path, monkeypatch, capsys):
    target = tmp_path / "mine.yaml"
    _, code, _ = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys, write=str(target),
                     recipe="gpt-oss-120b")
    assert code == 0
    assert "  recipe: gpt-oss-120b   # --recipe: the model, images and engines\n" in target.read_text()
    p = load_profile(target)
    assert (p.recipe, p.model.repo) == ("gpt-oss-120b", "openai/gpt-oss-120b")
    assert [(e.name, e.tensor_parallel) for e in p.engines] == [("vllm", 2)]


def test_an_unknown_recipe_reads_no_node(tmp_path, monkeypatch, capsys):
    ctx, code, _ = run(tmp_path, monkeypatch, spark_pair(tmp_path), capsys,
                       write=str(tmp_path / "mine.yaml"), recipe="nope")
    assert code == 2 and helper_args(ctx, "spark1") == []
