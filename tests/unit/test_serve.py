"""serve.up against scripted nodes: preflight lines, phases, exact docker run argv, stall ->
diagnosis -> fallback, an exited container failing at once, the API key only on stdin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sparkdeploy.core import labels
from sparkdeploy.core.fingerprint import digest, key_digests
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.records import Endpoint, ServeDecision
from sparkdeploy.engines import NodeFacts, launch
from sparkdeploy.engines.base import run_args
from sparkdeploy.node import endpoint as ep
from sparkdeploy.profile.config import ProfileError, load_profile
from sparkdeploy.steps import serve
from tests.unit.fakes import WALL, FakeClock, deployment
from tests.unit.serve_fakes import FakeCluster, FakeNode, Script, ServeContext

MODEL = "Qwen/Qwen3.5-122B-A10B-FP8"
SG_IMAGE = "sparkdeploy/sglang-qwen3.5:latest"
VL_IMAGE = "hellohal2064/vllm-qwen3.5-gb10"
IMG = "sha256:" + "a" * 64
HANG = ("[2026-12-02 17:00:03 TP0] CustomAllreduce is disabled because this process group spans "
        "across nodes.")


def facts(addr, ports=(), model=True, up=True, gid=3, peers=()):
    return {
        "iface": {"exists": True, "up": up, "addrs": [addr] if up else [], "mtu": 9000},
        "gid": {"index": gid, "hca": "rocep1s0f0", "all": [], "why": ""},
        "rdma_devices": False,
        "ports": {str(p): {"free": True} for p in ports},
        "peers": {p: {"open": True, "reachable": True} for p in peers},
        "model": {"present": model, "why": "" if model else "missing or empty: config.json"},
    }


@pytest.fixture
def lab(tmp_path, monkeypatch, seed_yaml):
    data = seed_yaml
    body = data["sparkdeploy"]
    body["serve"] = {"stall_s": 30, "poll_s": 1, "ready_timeout_s": 600}
    for n in body["nodes"]:
        n["docker_socket"] = f"/run/{n['name']}.sock"
    prof_path = tmp_path / "p.yaml"
    prof_path.write_text(yaml.safe_dump(data))
    prof = load_profile(prof_path)
    clock = FakeClock(now=1000.0, min_sleep=0.01)
    nodes = {
        "spark1": FakeNode("spark1", clock, facts("192.168.100.10", peers=["192.168.100.11"]),
                           {SG_IMAGE: IMG, VL_IMAGE: IMG}),
        "spark2": FakeNode("spark2", clock, facts("192.168.100.11"), {SG_IMAGE: IMG, VL_IMAGE: IMG}),
    }
    cluster = FakeCluster(clock, nodes, "spark1", "10.0.0.1")
    for k, fn in cluster.probes(MODEL).items():
        monkeypatch.setattr(ep, k, fn)
    monkeypatch.delenv("SPARKDEPLOY_API_KEY", raising=False)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    nodes["spark1"].selection = {  # what model.download recorded on the head
        "repo": MODEL, "revision": "main", "commit": "c" * 40, "files": [
            {"path": p, "size": 10, "sha256": None, "oid": "0" * 40}
            for p in ("config.json", *shards)],
        "selection": {"rule": "index", "weights": shards, "widened": [], "patterns": [],
                      "listed_files": 5, "listed_bytes": 50}}
    ctx = ServeContext(nodes)
    dep = deployment(prof_path, tmp_path / "state", ctx, clock=clock, profile=prof)
    return dep, ctx, nodes, cluster, clock


def healthy_sglang(nodes):
    nodes["spark1"].scripts["sparkdeploy-sglang-head"] = Script(
        [(1, "server_args=ServerArgs(...)"), (3, "Init torch distributed ends."),
         (8, "The server is fired up and ready to roll!")], opens={20000: 2, 30000: 8})
    nodes["spark2"].scripts["sparkdeploy-sglang-worker"] = Script([(1, "Init torch distributed ends.")])


def healthy_vllm(nodes, cluster):
    nodes["spark1"].scripts["sparkdeploy-vllm-ray-head"] = Script([(1, "Ray runtime started.")])
    nodes["spark2"].scripts["sparkdeploy-vllm-ray-worker"] = Script([(1, "Ray runtime started.")])
    nodes["spark1"].scripts["sparkdeploy-vllm-ray-api"] = Script(
        [(1, "vLLM API server version 0.17.0"), (5, "Starting vLLM API server on http://0.0.0.0:8000")],
        opens={8000: 5})
    cluster.ray_gpus.update({"192.168.100.10": 1.0, "192.168.100.11": 1.0})


def hung_sglang(nodes):
    """Both SGLang ranks start their distributed init and say nothing more."""
    nodes["spark1"].scripts["sparkdeploy-sglang-head"] = Script(
        [(1, "[2026-12-02 17:00:01] Init torch distributed begin."), (2, HANG)], opens={20000: 1})
    nodes["spark2"].scripts["sparkdeploy-sglang-worker"] = Script(
        [(1, "[2026-12-02 17:00:02] Init torch distributed begin."), (2, HANG)])


def runs(ctx, alias):
    return [argv[3:] for a, argv in ctx.calls if a == alias and argv[:1] == ["docker"]
            and argv[3:4] == ["run"]]


def test_sglang_comes_up_with_the_exact_containers_and_records_the_endpoint(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    results = serve.up(dep)
    assert [r.status for r in results][-1] is Status.OK
    assert results[-1].why == "endpoint: http://10.0.0.1:30000"
    want = launch(dep.profile, dep.profile.engines[0],
                  {"spark1": NodeFacts(3, False), "spark2": NodeFacts(3, False)}, image_id=IMG)
    [head], [worker] = runs(ctx, "spark1"), runs(ctx, "spark2")
    assert head == run_args(want.containers[0], started=labels.started("serve.up", WALL + 1000))
    assert worker == run_args(want.containers[1], started=labels.started("serve.up", WALL + 1002))
    fp = labels.engine_fingerprint(dep.profile, dep.profile.engines[0])
    assert sorted(a for a in head if a.startswith("--label=")) == [
        "--label=org.sparkdeploy.deployment=qwen3.5-122b-a10b-fp8",
        "--label=org.sparkdeploy.engine.kind=sglang",
        "--label=org.sparkdeploy.engine=sglang",
        f"--label=org.sparkdeploy.fingerprint.keys={json.dumps(key_digests(fp), separators=(',', ':'))}",
        f"--label=org.sparkdeploy.fingerprint={digest(fp)}",
        f"--label=org.sparkdeploy.image.id={IMG}",
        "--label=org.sparkdeploy.port=30000",
        "--label=org.sparkdeploy.rank=0",
        "--label=org.sparkdeploy.role=head",
        "--label=org.sparkdeploy.started.by=serve.up",
        "--label=org.sparkdeploy.started=2026-11-30T01:10:00Z",
    ]
    assert "--label=org.sparkdeploy.rank=1" in worker and "--label=org.sparkdeploy.role=worker" in worker
    # the worker started only after the head's init port answered over the fast link
    order = [(a, argv) for a, argv in ctx.calls if argv[3:4] == ["run"] or "connect" in argv]
    assert [a for a, _ in order][:2] == ["spark1", "spark2"] and "connect" in order[1][1]
    assert dep.records.read(Endpoint).url == "http://10.0.0.1:30000"
    assert dep.records.read(ServeDecision).chosen == "sglang"
    # the endpoint has one home: the engine decision does not repeat it
    assert "10.0.0.1" not in dep.records.path(ServeDecision).read_text()
    # a second serve.up finds it serving and changes nothing
    before = len(runs(ctx, "spark1"))
    again = serve.up(dep)
    assert [(r.status, r.why) for r in again] == [
        (Status.OK, "sglang serves as the profile says, since 2026-11-30T01:10:00Z"),
        (Status.OK, "endpoint: http://10.0.0.1:30000")]
    assert len(runs(ctx, "spark1")) == before


@pytest.mark.parametrize("case,edit,line", [
    ("worker unreachable", lambda n: setattr(n["spark2"], "unreachable", True),
     ("spark2", "unreachable: ssh: connect to host spark2 port 22: No route to host")),
    ("weights missing", lambda n: n["spark2"].facts["model"].update(
        present=False, why="missing or empty: model-00001-of-00004.safetensors"),
     ("spark2", "weights missing in /srv/models/Qwen3.5-122B-A10B-FP8: missing or empty: "
                "model-00001-of-00004.safetensors")),
    ("weights not verified", lambda n: n["spark2"].verify.update(
        ok=[], missing=["model-00002-of-00002.safetensors"],
        differ={"model-00001-of-00002.safetensors": "size 9 != 10"}),
     ("spark2", "weights not verified in /srv/models/Qwen3.5-122B-A10B-FP8: 2 files differ: "
                "model-00002-of-00002.safetensors (missing), model-00001-of-00002.safetensors "
                "(size 9 != 10) (model.verify, model.sync)")),
    ("weights never verified", lambda n: n["spark1"].verify.update(
        ok=["config.json"], unchecked=["model-00001-of-00002.safetensors"]),
     ("spark1", "weights not verified in /srv/models/Qwen3.5-122B-A10B-FP8: 1 file(s) never "
                "verified (model.verify --nodes spark1)")),
    ("port taken", lambda n: n["spark1"].facts["ports"].update(
        {"30000": {"free": False, "owner": "pid 77 python3"}}),
     ("spark1", "port 30000 is already in use by pid 77 python3")),
    ("gpu busy", lambda n: n["spark1"].gpu.append((4242, "python3")),
     ("spark1", "GPU busy: pid 4242 (python3)")),
    ("link down", lambda n: n["spark2"].facts.update(
        iface={"exists": True, "up": False, "addrs": [], "mtu": 9000}),
     ("spark2", "fast link enp1s0f0np0 is down")),
    ("worker not reachable on the link", lambda n: n["spark1"].facts["peers"].update(
        {"192.168.100.11": {"open": False, "reachable": False, "why": "timed out"}}),
     ("spark1", "cannot reach spark2 at 192.168.100.11 on the fast link (timed out)")),
    ("no gid", lambda n: n["spark1"].facts["gid"].update(index=None, why="rocep1s0f0: absent"),
     ("spark1", "no RoCE v2 GID for 192.168.100.10 on rocep1s0f0, roceP2p1s0f0 (rocep1s0f0: "
                "absent); set engines[].env.NCCL_IB_GID_INDEX to override")),
])
def test_preflight_each_problem_is_one_line_and_nothing_starts(lab, case, edit, line):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    edit(nodes)
    results = serve.up(dep, engine="sglang")
    bad = [(r.node, r.why) for r in results if r.failed]
    assert bad == [line]
    assert all("\n" not in r.why for r in results)
    assert not runs(ctx, "spark1") and not runs(ctx, "spark2")
    assert not any(argv[3:5] == ["rm", "--force"] for _, argv in ctx.calls)


@pytest.mark.parametrize("worker_has", [None, "sha256:" + "b" * 64])
def test_a_worker_without_the_heads_image_gets_it_shipped_first(lab, monkeypatch, worker_has):
    """Missing on the worker, or another image under the same name there (an older build):
    the head's, the one image.probe judged, is shipped before anything starts."""
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    if worker_has is None:
        del nodes["spark2"].images[SG_IMAGE]
    else:
        nodes["spark2"].images[SG_IMAGE] = worker_has
    shipped = []

    def fake_ship(ctx, to, image=None):
        shipped.append((to, image))
        nodes["spark2"].images[image] = IMG
        ctx.changed("sent", to)

    from sparkdeploy.steps import registry
    monkeypatch.setitem(registry.REGISTRY, "image.ship",
                        registry.StepSpec("image.ship", fake_ship))  # serve.up runs the step
    results = serve.up(dep, engine="sglang")
    assert shipped == [("spark2", SG_IMAGE)]
    assert ("image.ship", "spark2", "sent") in [(r.step, r.node, r.why) for r in results]
    assert results[-1].why == "endpoint: http://10.0.0.1:30000"


def test_hang_is_diagnosed_removed_everywhere_and_falls_back_to_vllm(lab):
    dep, ctx, nodes, cluster, clock = lab
    hung_sglang(nodes)
    healthy_vllm(nodes, cluster)
    t0 = clock()
    with dep.events.collect() as events:
        results = serve.up(dep)
    # vLLM served: the step succeeded (exit 0: the replaced engine's failure is superseded; it
    # is in the results, the stream and the record)
    assert [r for r in results if r.failed and not r.superseded] == []
    assert [r.why.split(":")[0] for r in results if r.failed] == ["sglang hang"]
    assert [r.status for r in results[-2:]] == [Status.CHANGED, Status.OK]
    sg_fail = next(e for e in events if isinstance(e, Result) and e.failed)
    assert sg_fail.why.startswith("sglang hang: no log output and no readiness step for 30s")
    assert "class: nccl-init-hang" in sg_fail.why and "falling back to vllm-ray" in sg_fail.why
    assert results[-1].why == "endpoint: http://10.0.0.1:8000"
    assert nodes["spark1"].removed == ["sparkdeploy-sglang-head"]
    assert nodes["spark2"].removed == ["sparkdeploy-sglang-worker"]
    rec = dep.records.read(ServeDecision)
    [tried] = rec.tried
    assert (tried.engine, tried.outcome, tried.diagnosis) == ("sglang", "hang", "nccl-init-hang")
    assert any(HANG in e[2] for e in tried.evidence)
    assert rec.chosen == "vllm-ray"
    # detected within the stall time + 10 % of the last output
    assert 30 <= tried.fallback_after_s <= 33
    logs = Path(tried.logs)
    assert sorted(p.name for p in logs.iterdir()) == [
        "spark1-sparkdeploy-sglang-head.log", "spark2-sparkdeploy-sglang-worker.log"]
    assert HANG in (logs / "spark1-sparkdeploy-sglang-head.log").read_text()
    assert clock() - t0 < 60
    assert sorted(nodes["spark1"].containers) == ["sparkdeploy-vllm-ray-api", "sparkdeploy-vllm-ray-head"]
    assert sorted(nodes["spark2"].containers) == ["sparkdeploy-vllm-ray-worker"]


def test_an_exited_container_fails_at_once_with_its_last_lines(lab):
    dep, ctx, nodes, cluster, clock = lab
    nodes["spark1"].scripts["sparkdeploy-sglang-head"] = Script(
        [(1, "loading"), (2, "KeyError: 'qwen3_5_moe'")], exit_at=3)
    healthy_vllm(nodes, cluster)
    t0 = clock()
    with dep.events.collect() as events:
        results = serve.up(dep, engine="sglang")
    assert [r for r in results if r.failed and not r.superseded] == []
    [bad] = [e for e in events if isinstance(e, Result) and e.failed]
    assert bad.why.startswith("sglang exited: spark1: sparkdeploy-sglang-head exited (exit code 1) "
                              "during the head's init port 192.168.100.10:20000")
    assert "last lines: loading | KeyError: 'qwen3_5_moe'" in bad.why
    assert "class: model-config-unrecognized" in bad.why
    assert not [a for a in runs(ctx, "spark2") if "--name=sparkdeploy-sglang-worker" in a]
    rec = dep.records.read(ServeDecision)
    assert rec.tried[0].outcome == "exited" and rec.chosen == "vllm-ray"
    assert rec.tried[0].fallback_after_s is None
    # the file keeps its keys: the diagnosis as "class", no hang's timings for an engine that exited
    [written] = json.loads(dep.records.path(ServeDecision).read_text())["data"]["tried"]
    assert written["class"] == "model-config-unrecognized"
    assert not {"fallback_after_s", "stall_s", "silent_s", "hang_start", "diagnosis"} & set(written)
    assert clock() - t0 < 20
    assert results[-1].why == "endpoint: http://10.0.0.1:8000"


def test_ray_missing_worker_gpu_is_a_hang_not_a_success(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_vllm(nodes, cluster)
    cluster.ray_gpus.pop("192.168.100.11")
    results = serve.up(dep, engine="vllm-ray")
    bad = [r for r in results if r.failed]
    assert bad[0].why.startswith("vllm-ray hang: no log output and no readiness step for 30s during "
                                 "Ray listing every node with its GPU")
    assert bad[0].why.endswith("; falling back to vllm")  # the next engine, which has no script here
    assert not nodes["spark1"].containers and not nodes["spark2"].containers


def test_api_key_reaches_vllm_on_stdin_only(lab, monkeypatch):
    dep, ctx, nodes, cluster, clock = lab
    healthy_vllm(nodes, cluster)
    monkeypatch.setenv("SPARKDEPLOY_API_KEY", "sk-local-test-9f8e7d")
    results = serve.up(dep, engine="vllm-ray")
    assert results[-1].why == "endpoint: http://10.0.0.1:8000"
    assert nodes["spark1"].stdin == {"sparkdeploy-vllm-ray-api": "VLLM_API_KEY=sk-local-test-9f8e7d\n"}
    assert not any("sk-local-test" in c for c in ctx.commands)
    [api] = [a for a in runs(ctx, "spark1") if "--name=sparkdeploy-vllm-ray-api" in a]
    assert "--env-file=/dev/stdin" in api
    journal = (dep.state.journal_path).read_text()
    assert "sk-local-test" not in journal


def test_secrets_in_the_engines_env_reach_the_containers_on_stdin_only(lab):
    """HF_TOKEN and *_KEY from the profile's engine env: on stdin (docker's env file), never an
    --env argument on a node's command line or in the journal; the rest stays --env."""
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    eng = dep.profile.engines[0].model_copy(update={"env": {
        "HF_TOKEN": "hf_ProfileTokenNeverOnArgv01", "S3_ACCESS_KEY": "ak-never-on-argv",
        "NCCL_DEBUG": "INFO"}})
    dep.profile = dep.profile.model_copy(update={"engines": [eng, *dep.profile.engines[1:]]})
    assert serve.up(dep)[-1].why == "endpoint: http://10.0.0.1:30000"
    want = "HF_TOKEN=hf_ProfileTokenNeverOnArgv01\nS3_ACCESS_KEY=ak-never-on-argv\n"
    assert nodes["spark1"].stdin == {"sparkdeploy-sglang-head": want}
    assert nodes["spark2"].stdin == {"sparkdeploy-sglang-worker": want}
    for node in ("spark1", "spark2"):
        [argv] = runs(ctx, node)
        assert "--env-file=/dev/stdin" in argv and "--env=NCCL_DEBUG=INFO" in argv
        assert not any("HF_TOKEN" in a or "S3_ACCESS_KEY" in a for a in argv)
    assert not any("NeverOnArgv" in c or "never-on-argv" in c for c in ctx.commands)
    journal = dep.state.journal_path.read_text()
    assert "NeverOnArgv" not in journal and "never-on-argv" not in journal


def test_down_removes_every_container_and_status_reports(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    st = serve.status(dep)
    assert [(r.node, r.why) for r in st] == [
        ("spark1", "sparkdeploy-sglang-head running since 2026-11-30T01:10:00Z by serve.up"),
        ("spark2", "sparkdeploy-sglang-worker running since 2026-11-30T01:10:02Z by serve.up"),
        (None, "endpoint: http://10.0.0.1:30000 healthy (sglang since 2026-11-30T01:10:00Z), "
               f"serves {MODEL}"),
        (None, "sglang: bring-up 8.0 s (running 2.0 s, dist init 3.0 s, port 8.0 s, health 8.0 s, "
               "listed 8.0 s, first token 8.0 s)")]
    down = serve.down(dep)
    assert [(r.node, r.status, r.why) for r in down] == [
        ("spark1", Status.CHANGED, "removed sparkdeploy-sglang-head"),
        ("spark2", Status.CHANGED, "removed sparkdeploy-sglang-worker")]
    again = serve.down(dep)
    assert [r.status for r in again] == [Status.OK, Status.OK]


def test_unknown_engine_is_one_line(lab):
    dep, *_ = lab
    with pytest.raises(ProfileError, match=r"^--engine: no engine named 'tgi' \(engines: sglang, vllm-ray, vllm\)$"):
        serve.up(dep, engine="tgi")


def test_serve_node_facts_argv(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    [wrapped] = [argv for a, argv in ctx.calls if a == "spark1" and "facts" in argv]
    # run only after the staged helper's sha256 checks out
    assert wrapped[:2] == ["sh", "-c"] and "sha256sum -c --status" in wrapped[2]
    facts = wrapped[4:]
    assert facts[3:] == ["--iface", "enp1s0f0np0", "--addr", "192.168.100.10", "--hca", "rocep1s0f0",
                         "--hca", "roceP2p1s0f0", "--port", "20000", "--port", "30000", "--model",
                         "/srv/models/Qwen3.5-122B-A10B-FP8", "--peer", "192.168.100.11"]
    assert facts[0] == "python3" and facts[1].endswith("/serve_node.py") and facts[1] in wrapped[2]


def test_a_second_controller_reads_the_deployment_from_the_nodes(lab, tmp_path):
    """Another state dir (a fresh clone): status, serve.up and serve.down read the nodes' labels."""
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    other = deployment(Path(dep.profile_path), tmp_path / "other", ctx, clock=clock,
                       profile=dep.profile)
    assert other.records.read(Endpoint) is None
    st = serve.status(other)
    assert st[-1].why == ("endpoint: http://10.0.0.1:30000 healthy (sglang since "
                          f"2026-11-30T01:10:00Z), serves {MODEL}")
    before = len(runs(ctx, "spark1"))
    again = serve.up(other)
    assert [r.why for r in again] == ["sglang serves as the profile says, since 2026-11-30T01:10:00Z",
                                      "endpoint: http://10.0.0.1:30000"]
    assert len(runs(ctx, "spark1")) == before
    assert other.records.read(Endpoint).url == "http://10.0.0.1:30000"  # the cache, refilled
    assert [r.why for r in serve.down(other)] == ["removed sparkdeploy-sglang-head",
                                                  "removed sparkdeploy-sglang-worker"]


def test_a_deployment_serving_something_else_says_what_and_is_redeployed(lab, tmp_path):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    eng = dep.profile.engines[0].model_copy(update={"args": [*dep.profile.engines[0].args, "--x"]})
    other = deployment(Path(dep.profile_path), tmp_path / "other", ctx, clock=clock,
                       profile=dep.profile.model_copy(update={"engines": [eng]}))
    st = serve.status(other)
    assert (st[-1].status, st[-1].why) == (Status.FAILED,
                                          "sglang on the nodes differs from the profile: engine.args"
                                          f"[{len(dep.profile.engines[0].args)}]")
    healthy_sglang(nodes)
    res = serve.up(other)
    assert res[0].why == ("removed this deployment's old containers (sglang on the nodes differs "
                          f"from the profile: engine.args[{len(eng.args) - 1}]): spark1: "
                          "sparkdeploy-sglang-head, "
                          "spark2: sparkdeploy-sglang-worker")
    assert res[-1].why == "endpoint: http://10.0.0.1:30000"
    [head] = [c for c in nodes["spark1"].containers.values()]
    assert "--x" in head.run_argv


def test_an_interrupted_start_removes_what_it_started(lab):
    """Ctrl-C (or a node lost) while the engine comes up: its containers go on every node."""
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    real = serve.bring_up

    def interrupted(dep_, lau, run, watch):
        serve.start(dep_, dep_.host("spark1"), lau.containers[0], {})
        raise KeyboardInterrupt

    serve.bring_up = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            serve.up(dep)
    finally:
        serve.bring_up = real
    assert nodes["spark1"].containers == {} and nodes["spark1"].removed == ["sparkdeploy-sglang-head"]


def _probed(dep, sglang_version: str) -> None:
    """What image.probe records: the sglang engine serves from the layer over scitrera's image,
    whose SGLang version the probe read."""
    from sparkdeploy.core.records import Candidate, EngineImage, ImageDecision
    base = "scitrera/dgx-spark-sglang:0.5.10rc0"
    dep.records.write(ImageDecision(
        node="spark1", arch="arm64", config_from=base, chosen=None,
        engines={"sglang": EngineImage(image=base, kind="sglang", needs_layer=True,
                                       serve_image=SG_IMAGE)},
        candidates=[Candidate(image="lmsysorg/sglang:spark", engine="sglang", verdict="rejected",
                              engine_version="0.5.4"),
                    Candidate(image=base, engine="sglang", verdict="viable",
                              engine_version=sglang_version)],
        summary="sglang: layer over " + base))


def test_the_engine_flags_are_checked_against_the_probed_version_before_anything_starts(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    _probed(dep, "0.5.10rc0")
    dep.profile.engines[0].args.extend(["--mem-fraction-statik", "0.8"])
    results = serve.up(dep, engine="sglang")
    bad = [(r.node, r.why) for r in results if r.failed]
    assert bad == [("spark1", "sglang: --mem-fraction-statik: not a flag of sglang 0.5.10rc0; "
                               "did you mean --mem-fraction-static?")]
    assert not runs(ctx, "spark1") and not runs(ctx, "spark2")


def test_a_refused_flag_removes_nothing_of_the_serving_deployment(lab, tmp_path):
    """The issue's typo while the lab serves: the flag is refused before the old containers go
    (it used to remove them first, then refuse: the typo cost the running model)."""
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    _probed(dep, "0.5.10rc0")
    eng = dep.profile.engines[0]
    bad = eng.model_copy(update={"args": [*eng.args, "--mem-fraction-statik", "0.8"]})
    other = deployment(Path(dep.profile_path), dep.state.path, ctx, clock=clock,
                       profile=dep.profile.model_copy(update={"engines": [bad]}))
    before = len(ctx.calls)
    results = serve.up(other)
    assert [(r.node, r.why) for r in results if r.failed] == [
        ("spark1", "sglang: --mem-fraction-statik: not a flag of sglang 0.5.10rc0; "
                   "did you mean --mem-fraction-static?")]
    removals = [argv for _, argv in ctx.calls[before:] if argv[:2] in (["docker", "rm"], ["docker", "stop"])
                or "rm" in argv[:4]]
    assert removals == [] and not [r for r in results if "removed" in r.why]
    assert set(nodes["spark1"].containers) == {"sparkdeploy-sglang-head"}  # still serving


def test_flags_that_the_engine_accepts_pass_and_the_preflight_says_against_what(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    _probed(dep, "0.5.4")
    results = serve.up(dep, engine="sglang")
    assert not [r for r in results if r.failed], [r.why for r in results if r.failed]
    [pre] = [r for r in results if (r.details or {}).get("part") == "preflight"]
    assert "flags checked against sglang 0.5.4" in pre.why


def test_an_engine_version_without_a_manifest_stops_the_preflight(lab):
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    _probed(dep, "0.5.99")
    bad = [(r.node, r.why) for r in serve.up(dep, engine="sglang") if r.failed]
    assert bad == [("spark1", "sglang: no flag manifest for sglang 0.5.99: make one with "
                              "`nox -s engine_flags -- sglang==0.5.99`")]


def test_serve_up_times_each_startup_milestone_from_the_engines_start(lab):
    from sparkdeploy.ops.serve import STARTUP, startup_line

    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    results = serve.up(dep)
    rec = dep.records.read(ServeDecision)
    assert set(rec.startup) == set(STARTUP)
    got = [rec.startup[k] for k in STARTUP]
    assert got == sorted(got)
    # the engine's own line (3 s after the head started) marks the distributed init, seen at the
    # first poll after it; the API port opens 8 s after the head started
    poll = dep.profile.serve.poll_s
    assert 3 <= rec.startup["dist_init"] <= 3 + 2 * poll
    assert rec.startup["port_open"] >= 8
    assert results[-2].why == (f"sglang serves {dep.profile.model.repo}; "
                               f"{startup_line(rec.startup)}")
    assert results[-2].details["startup"] == rec.startup
    assert "sglang: bring-up " in dep.records.path(ServeDecision).with_suffix(".md").read_text()
    # serve.status says it again, from the record on the nodes' deployment
    status = [r.why for r in serve.status(dep)]
    assert f"sglang: {startup_line(rec.startup)}" in status


def test_an_engine_given_up_on_keeps_the_milestones_it_reached(lab):
    dep, ctx, nodes, cluster, clock = lab
    hung_sglang(nodes)
    healthy_vllm(nodes, cluster)
    nodes["spark1"].scripts["sparkdeploy-vllm-ray-api"].lines.append(
        (3, "(RayWorkerWrapper pid=311) INFO 12-02 17:00:03 [parallel_state.py:1326] rank 1 in "
            "world size 2 is assigned as DP rank 0, PP rank 0, TP rank 1, EP rank 1"))
    serve.up(dep)
    [tried] = dep.records.read(ServeDecision).tried
    assert set(tried.startup) == {"containers_running"}  # never past the distributed init
    assert "dist_init" in dep.records.read(ServeDecision).startup  # vLLM's ranks said they joined


def test_startup_line_names_the_milestones_reached_in_order():
    from sparkdeploy.ops.serve import startup_line

    assert startup_line({"port_open": 40.25, "containers_running": 3.1, "first_token": 41.0}) == (
        "bring-up 41.0 s (running 3.1 s, port 40.2 s, first token 41.0 s)")
    assert startup_line({}) == "bring-up: no milestone reached"
