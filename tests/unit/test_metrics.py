"""metrics.up / metrics.down on scripted nodes: what is refused before anything is written, the
exact files and units written, what a re-run restarts (nothing), serve.down's removal; the
exporter's series from the files a node holds; the shipped rules and dashboard."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import pytest
import yaml

from sparkdeploy.core import labels
from sparkdeploy.core.outcomes import Status
from sparkdeploy.ops import metrics as mx
from sparkdeploy.steps import metrics as step
from sparkdeploy.steps.registry import run_one
from tests.unit.fakes import EngineContainer, FakeClock, FakeNode, ScriptedContext, deployment
from tests.unit.profiles import SEED

ADDR = {"spark1": "192.168.1.11", "spark2": "192.168.1.12"}
IMAGE = "sha256:" + "ab" * 32
HEAD_LABELS = {labels.DEPLOYMENT: "qwen3.5-122b-a10b-fp8", labels.ENGINE: "vllm",
               labels.ENGINE_KIND: "vllm", labels.ROLE: "head", labels.RANK: "0",
               labels.PORT: "8000", labels.IMAGE_ID: IMAGE, labels.RECIPE: "qwen3.5-122b",
               labels.STARTED: "2026-12-07T18:00:00Z"}


@dataclass
class MetricsNode(FakeNode):
    """A node as metrics.up reads it: ss, command -v, sha256sum, systemctl is-active and the
    serving image's import check, beside the scripted node's units, files and containers."""

    listening: dict[int, str] = field(default_factory=dict)
    programs: dict[str, str] = field(default_factory=dict)
    has_client: bool = True
    images: set[str] = field(default_factory=set)
    ran: list[list[str]] = field(default_factory=list)

    sudo: list[list[str]] = field(default_factory=list)
    """The commands that ran through ``sudo -n``."""

    def answer(self, argv, stdin=None):
        bare = argv[3:] if argv[:3] == ["sudo", "-n", "--"] else argv
        self.ran.append(bare)
        if bare is not argv:
            self.sudo.append(bare)
        if bare == ["ss", "-Hltnp"]:
            return 0, "".join(f'LISTEN 0 4096 0.0.0.0:{p} 0.0.0.0:* users:(("{who}",pid=7,fd=3))\n'
                              for p, who in self.listening.items()), ""
        if bare[:2] == ["sh", "-c"] and bare[2].startswith("command -v"):
            path = self.programs.get(bare[-1])
            return (0, path + "\n", "") if path else (1, "", "")
        if bare[:2] == ["sha256sum", "--"]:
            got = self.node_files.get(bare[2])
            return (0, f"{hashlib.sha256(got.encode()).hexdigest()}  {bare[2]}\n", "") if got \
                is not None else (1, "", f"sha256sum: {bare[2]}: No such file or directory")
        if bare[:2] == ["sh", "-c"] and 'for f in "$1"/*.json' in bare[2]:  # the units' specs
            return 0, "".join(f"{p}\n{t}\n#end\n" for p, t in sorted(self.node_files.items())
                              if p.startswith(bare[4] + "/") and p.endswith(".json")), ""
        if bare[:2] == ["sh", "-c"] and "for f" in bare[2]:
            return 0, "".join(f"{p}\n" for p in bare[4:] if p in self.node_files), ""
        if bare[:3] == ["systemctl", "is-active", "--"]:
            states = [self.units.get(u, "inactive") for u in bare[3:]]
            return (0 if all(s == "active" for s in states) else 3), "\n".join(states) + "\n", ""
        if bare[:2] == ["systemctl", "daemon-reload"]:
            return 0, "", ""
        if bare[:2] == ["systemctl", "restart"]:
            self.units[bare[3]] = "active"
            return 0, "", ""
        if bare[:2] == ["systemctl", "start"]:
            if bare[3] in self.fail_start:
                return 1, "", f"Job for {bare[3]} failed."
            self.units[bare[3]] = "active"
            return 0, "", ""
        if bare[:2] == ["systemctl", "stop"]:
            self.units[bare[3]] = "inactive"
            return 0, "", ""
        if bare[:2] == ["docker", "-H"] and bare[3] == "run":
            return (0, "", "") if self.has_client else (
                1, "", "ModuleNotFoundError: No module named 'prometheus_client'")
        if bare[:2] == ["docker", "-H"] and bare[3:5] == ["image", "inspect"]:
            if bare[-1] in self.images:
                return 0, json.dumps({"Id": "sha256:" + "cd" * 32}) + "\n", ""
            return 1, "", "Error: No such image"
        return super().answer(argv, stdin)


class Ctx(ScriptedContext):
    def answer(self, alias, argv, stdin, command, kw):
        if alias is None and "-G" in argv:  # ssh -G: the alias' HostName
            return self.result(command, 0, f"hostname {ADDR[argv[-1]]}\nport 22\n")
        return super().answer(alias, argv, stdin, command, kw)


def nodes(**kw) -> dict[str, MetricsNode]:
    head = MetricsNode(containers=[EngineContainer("sparkdeploy-vllm-head", dict(HEAD_LABELS), [1])],
                       programs={"prometheus": "/usr/bin/prometheus"}, **kw)
    worker = MetricsNode(containers=[EngineContainer("sparkdeploy-vllm-worker", {
        **HEAD_LABELS, labels.ROLE: "worker", labels.RANK: "1", labels.PORT: ""}, [2])])
    return {"spark1": head, "spark2": worker}


def outcome(results: list) -> tuple:
    """The step's last result: (status, why)."""
    return results[-1].status, results[-1].why


@pytest.fixture
def up_targets(monkeypatch):
    """Prometheus' answer: every target up (what its /api/v1/targets says once it scraped)."""
    seen: list[str] = []

    def targets(url):
        seen.append(url)
        return [step._Target(scrapeUrl=u, health="up") for u in (
            "http://192.168.1.11:8000/metrics", "http://192.168.1.11:9408/metrics",
            "http://192.168.1.12:9408/metrics")]

    monkeypatch.setattr(step, "targets", targets)
    monkeypatch.setattr(step, "page_up", lambda url: seen.append(url) or True)
    return seen


def test_with_serve_adds_gateway_on_the_head_prometheus_scrapes_it_too(tmp_path, monkeypatch):
    ns = nodes()
    ns["spark1"].node_files[f"{mx.UNIT_DIR}/sparkdeploy-gateway.service"] = "[Unit]\n"
    dep, _ = dep_of(tmp_path, ns)
    want: list[int] = []

    def targets(url):
        return [step._Target(scrapeUrl=f"http://t{i}/metrics", health="up") for i in range(4)]

    monkeypatch.setattr(step, "targets", targets)
    monkeypatch.setattr(step, "page_up", lambda url: True)
    real = step._ready
    monkeypatch.setattr(step, "_ready", lambda ctx, url, n: want.append(n) or real(ctx, url, n))
    results = run_one(dep, "metrics.up")
    assert not [r for r in results if r.failed], results
    conf = yaml.safe_load(ns["spark1"].node_files[mx.CONFIG])
    assert conf["scrape_configs"][-1] == {"job_name": "gateway",
                                          "static_configs": [{"targets": ["192.168.1.11:8888"]}]}
    assert want == [4]  # the engine, two exporters and the gateway


def dep_of(tmp_path, ns, dry=False):
    ctx = Ctx(ns, dry=dry)
    clock = FakeClock()
    return deployment(SEED, tmp_path / "state", ctx, dry=dry, clock=clock), ctx


def test_metrics_up_writes_the_files_and_starts_the_units_then_a_rerun_changes_nothing(
        tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    results = run_one(dep, "metrics.up")
    assert [(r.status, r.why) for r in results] == [
        (Status.CHANGED, "started spark1: sparkdeploy-exporter.service, sparkdeploy-prometheus.service, "
                         "sparkdeploy-status.service; spark2: sparkdeploy-exporter.service"),
        (Status.OK, "metrics: http://192.168.1.11:9090 (3 targets up)"),
        (Status.OK, "status: http://192.168.1.11:9480")]
    head, worker = ns["spark1"], ns["spark2"]
    assert up_targets[-2:] == ["http://192.168.1.11:9090", "http://192.168.1.11:9480"]
    status = head.node_files[f"{mx.UNIT_DIR}/{mx.STATUS_UNIT}"]
    assert ("ExecStart=/usr/bin/python3 /var/lib/sparkdeploy-node/metrics/status_page.py "
            "--listen=0.0.0.0:9480 --prometheus=http://127.0.0.1:9090 "
            "--state=/var/lib/sparkdeploy-node\n") in status
    unit = head.node_files[f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}"]
    assert ("ExecStart=/usr/bin/docker -H unix:///var/run/docker.sock run --rm "
            "--name=sparkdeploy-exporter --network=host --read-only "
            "--volume=/var/lib/sparkdeploy-node:/sparkdeploy:ro --entrypoint=python3 " + IMAGE +
            " /sparkdeploy/metrics/metrics_exporter.py --listen=0.0.0.0:9408 --node=spark1 "
            "--state=/sparkdeploy --interface=enp1s0f0np0\n") in unit
    assert ("ExecStop=/usr/bin/docker -H unix:///var/run/docker.sock rm --force sparkdeploy-exporter\n"
            in unit)
    prom_unit = head.node_files[f"{mx.UNIT_DIR}/{mx.PROMETHEUS_UNIT}"]
    assert ("ExecStart=/usr/bin/prometheus --config.file=/var/lib/sparkdeploy-node/metrics/prometheus.yml"
            " --storage.tsdb.path=/var/lib/sparkdeploy-node/metrics/tsdb --storage.tsdb.retention.time=15d"
            " --web.listen-address=0.0.0.0:9090\n") in prom_unit
    assert "ExecStop" not in prom_unit  # the package's binary ends with its unit
    conf = yaml.safe_load(head.node_files[mx.CONFIG])
    assert conf["global"]["scrape_interval"] == "15s"
    assert conf["rule_files"] == ["/var/lib/sparkdeploy-node/metrics/rules.yml"]
    assert conf["scrape_configs"] == [
        {"job_name": "engine", "metrics_path": "/metrics", "static_configs": [
            {"targets": ["192.168.1.11:8000"], "labels": {"sparkdeploy_engine": "vllm"}}]},
        {"job_name": "sparkdeploy", "honor_labels": True, "static_configs": [
            {"targets": ["192.168.1.11:9408"], "labels": {"node": "spark1"}},
            {"targets": ["192.168.1.12:9408"], "labels": {"node": "spark2"}}]}]
    assert json.loads(worker.node_files[mx.DEPLOYMENT_FILE]) == {
        "deployment": "qwen3.5-122b-a10b-fp8", "engine": "vllm", "kind": "vllm",
        "image_digest": IMAGE, "recipe": "qwen3.5-122b", "role": "worker", "ranks": "1",
        "since": 1796666400.0}
    assert mx.PROMETHEUS_UNIT not in str(worker.node_files) and mx.CONFIG not in worker.node_files
    units = [mx.EXPORTER_UNIT, mx.PROMETHEUS_UNIT, mx.STATUS_UNIT]
    assert [a for a in head.ran if a[0] == "systemctl"] == [
        ["systemctl", "is-active", "--", *units],
        ["systemctl", "daemon-reload"],
        ["systemctl", "is-active", "--", *units],
        ["systemctl", "start", "--", mx.EXPORTER_UNIT],
        ["systemctl", "start", "--", mx.PROMETHEUS_UNIT],
        ["systemctl", "start", "--", mx.STATUS_UNIT]]
    # again: nothing written, nothing (re)started
    before = dict(head.node_files)
    head.ran.clear()
    results = run_one(dep, "metrics.up")
    assert [(r.status, r.why) for r in results] == [
        (Status.OK, "metrics: http://192.168.1.11:9090 (3 targets up), as it was"),
        (Status.OK, "status: http://192.168.1.11:9480")]
    assert head.node_files == before
    assert [a for a in head.ran if a[:2] in (["systemctl", "start"], ["systemctl", "restart"],
                                              ["systemctl", "daemon-reload"])] == []
    rec = json.loads((tmp_path / "state/decisions/qwen3.5-122b-a10b-fp8/metrics.json").read_text())
    assert rec["data"]["ports"] == {"spark1": [9408, 9090, 9480], "spark2": [9408]}


def test_a_changed_scrape_interval_restarts_prometheus_alone(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    dep.profile = dep.profile.model_copy(update={"metrics": dep.profile.metrics.model_copy(
        update={"scrape_s": 5})})
    ns["spark1"].ran.clear()
    ns["spark2"].ran.clear()
    results = run_one(dep, "metrics.up")
    assert results[0].why == "started spark1: sparkdeploy-prometheus.service"
    assert ["systemctl", "restart", "--", mx.PROMETHEUS_UNIT] in ns["spark1"].ran
    assert not [a for a in ns["spark2"].ran if a[:1] == ["systemctl"] and a[1] != "is-active"]


@pytest.mark.parametrize("case, want", [
    ("no-prometheus", "spark1: no prometheus on the PATH (apt install prometheus; or "
                      "metrics.prometheus: image)"),
    ("port", "spark2: port 9408 is held by dcgm-exporter (metrics.exporter_port)"),
    ("client", "spark1: the serving image sha256:abababababab has no prometheus_client (the "
               "exporter runs in it): ModuleNotFoundError: No module named 'prometheus_client'"),
])
def test_what_cannot_work_is_refused_before_anything_is_written(tmp_path, up_targets, case, want):
    ns = nodes()
    if case == "no-prometheus":
        ns["spark1"].programs.clear()
    elif case == "port":
        ns["spark2"].listening[9408] = "dcgm-exporter"
    else:
        ns["spark1"].has_client = False
    dep, _ = dep_of(tmp_path, ns)
    results = run_one(dep, "metrics.up")
    assert [(r.status, r.why) for r in results] == [(Status.FAILED, want)]
    assert all(n.node_files == {} for n in ns.values())
    assert up_targets == []


def test_a_port_its_own_unit_holds_is_no_refusal(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    ns["spark1"].listening.update({9090: "prometheus", 9408: "python3"})
    assert run_one(dep, "metrics.up")[-1].status is Status.OK


def test_off_or_nothing_serving_is_skipped_and_touches_nothing(tmp_path, up_targets):
    ns = nodes()
    for n in ns.values():
        n.containers.clear()
    dep, _ = dep_of(tmp_path, ns)
    [r] = run_one(dep, "metrics.up")
    assert (r.status, r.why) == (Status.SKIPPED, "nothing of qwen3.5-122b-a10b-fp8 serves on the "
                                                 "nodes (serve.up first)")
    dep.profile = dep.profile.model_copy(update={"metrics": dep.profile.metrics.model_copy(
        update={"enabled": False})})
    [r] = run_one(dep, "metrics.up")
    assert (r.status, r.why) == (Status.SKIPPED, "metrics.enabled is false in the profile")
    assert all(n.node_files == {} for n in ns.values())


def test_targets_that_never_come_up_fail_with_what_prometheus_said(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "targets", lambda url: [
        step._Target(scrapeUrl="http://192.168.1.11:8000/metrics", health="up"),
        step._Target(scrapeUrl="http://192.168.1.11:9408/metrics", health="up"),
        step._Target(scrapeUrl="http://192.168.1.12:9408/metrics", health="down",
                     lastError="connection refused")])
    monkeypatch.setattr(step, "page_up", lambda url: True)
    dep, _ = dep_of(tmp_path, nodes())
    results = run_one(dep, "metrics.up")
    assert outcome(results) == (
        Status.FAILED, "the metrics at http://192.168.1.11:9090 are not ready after 90 s: "
                       "http://192.168.1.12:9408/metrics down (connection refused)")
    monkeypatch.setattr(step, "targets", lambda url: [
        step._Target(scrapeUrl=f"http://192.168.1.1{i}:9408/metrics", health="up") for i in (1, 1, 2)])
    monkeypatch.setattr(step, "page_up", lambda url: False)
    results = run_one(dep, "metrics.up")
    assert outcome(results) == (
        Status.FAILED, "the metrics at http://192.168.1.11:9090 are not ready after 90 s: "
                       "the status page http://192.168.1.11:9480 does not answer")


def test_metrics_down_and_serve_down_stop_and_remove_the_units_and_files(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    results = run_one(dep, "metrics.down")
    assert [(r.node, r.why) for r in results] == [
        ("spark1", "stopped and removed sparkdeploy-exporter.service, sparkdeploy-prometheus.service, "
                   "sparkdeploy-status.service"),
        ("spark2", "stopped and removed sparkdeploy-exporter.service")]
    assert set(ns["spark1"].node_files) == set()
    assert ns["spark1"].units == {mx.EXPORTER_UNIT: "inactive", mx.PROMETHEUS_UNIT: "inactive",
                                  mx.STATUS_UNIT: "inactive"}
    assert [(r.node, r.why) for r in run_one(dep, "metrics.down")] == [
        ("spark1", "no metrics unit"), ("spark2", "no metrics unit")]


def test_the_prometheus_image_runs_as_a_unit_that_removes_its_container():
    from tests.unit.fakes import deployment as dep_

    dep = dep_(SEED, __import__("pathlib").Path("/nonexistent"))
    dep.profile = dep.profile.model_copy(update={"metrics": dep.profile.metrics.model_copy(
        update={"prometheus": "image"})})
    assert mx.prometheus_start(dep, None) == [
        "/usr/bin/docker", "-H", "unix:///var/run/docker.sock", "run", "--rm",
        "--name=sparkdeploy-prometheus", "--network=host", "--user=0",
        "--volume=/var/lib/sparkdeploy-node/metrics:/var/lib/sparkdeploy-node/metrics",
        "prom/prometheus:v3.7.3", "--config.file=/var/lib/sparkdeploy-node/metrics/prometheus.yml",
        "--storage.tsdb.path=/var/lib/sparkdeploy-node/metrics/tsdb",
        "--storage.tsdb.retention.time=15d", "--web.listen-address=0.0.0.0:9090"]


def test_figures_carry_numbers_and_words_only():
    got = json.loads(mx.figures_json(
        {"verdict": "ok", "expected_gbs": 12.5, "why": "x", "sizes": [
            {"bytes": 1048576, "algbw_gbs": 1.0, "busbw_gbs": 1.0}], "engine": "vllm"},
        {"output_tok_s": 27.1, "ttft_ms_median": 50.0, "itl_ms_median": 36.0, "time": 1.0, "x": 2}))
    assert got == {"fabric": {"verdict": "ok", "expected_gbs": 12.5,
                              "sizes": [{"bytes": 1048576, "busbw_gbs": 1.0}]},
                   "bench": {"output_tok_s": 27.1, "ttft_ms_median": 50.0, "itl_ms_median": 36.0,
                             "time": 1.0}}
    assert mx.figures_json(None, None) == "{}\n"


def test_a_port_clash_in_the_profile_is_one_line(tmp_path):
    from sparkdeploy.profile.config import ProfileError, load_profile

    p = tmp_path / "p.yaml"
    p.write_text(f"extends: {SEED}\nsparkdeploy:\n  metrics: {{port: 9408}}\n")
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value).endswith("sparkdeploy.metrics: port and exporter_port are both 9408")
    p.write_text(f"extends: {SEED}\nsparkdeploy:\n  metrics: {{status_port: 9408}}\n")
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value).endswith("sparkdeploy.metrics: exporter_port and status_port are both 9408")


# --- the exporter, on files as a node holds them -----------------------------------------------

def exporter_text(tmp_path, deployment=None, figures=None, restarts=None, swap=None) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from sparkdeploy.data import metrics_exporter as ex

    state = tmp_path / "state"
    (state / "metrics").mkdir(parents=True)
    (state / "serve").mkdir()
    if deployment is not None:
        (state / "metrics" / "deployment.json").write_text(json.dumps(deployment))
    if figures is not None:
        (state / "metrics" / "figures.json").write_text(figures)
    if restarts is not None:
        (state / "serve" / "vllm.restarts.json").write_text(json.dumps({"restarts": restarts}))
    if swap is not None:
        (state / "swap.json").write_text(json.dumps(swap))
    (tmp_path / "meminfo").write_text("MemTotal:       127535616 kB\nMemAvailable:   98304000 kB\n"
                                      "HugePages_Total:       0\n")
    stats = tmp_path / "net" / "enp1s0f0np0" / "statistics"
    stats.mkdir(parents=True)
    for i, name in enumerate(ex.LINK_COUNTERS):
        (stats / name).write_text(f"{1000 + i}\n")
    reg = CollectorRegistry()
    reg.register(ex.NodeCollector("spark1", str(state), "enp1s0f0np0", proc=str(tmp_path / "meminfo"),
                                  net=str(tmp_path / "net")))
    return generate_latest(reg).decode()


def samples(text: str) -> dict[str, float]:
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_the_exporter_reports_what_the_nodes_files_say(tmp_path):
    got = samples(exporter_text(
        tmp_path,
        deployment={"deployment": "d", "recipe": "r", "engine": "vllm", "kind": "vllm",
                    "image_digest": IMAGE, "role": "head", "ranks": "0,1", "since": 1796666400.0},
        figures=mx.figures_json({"verdict": "degraded", "expected_gbs": 12.5, "sizes": [
            {"bytes": 1048576, "busbw_gbs": 0.5}]}, {"output_tok_s": 27.0, "time": 5.0}),
        restarts=[{"class": "nccl-hang", "outcome": "restarted"},
                  {"class": "nccl-hang", "outcome": "restarted"}, {"outcome": "restarted"}],
        swap={"phase": "cut-over", "deployment": "d", "from_model": "a/b", "to_model": "c/d"}))
    assert got['sparkdeploy_swap_phase{from_model="a/b",node="spark1",phase="cut-over",to_model="c/d"}'] == 1
    assert got[f'sparkdeploy_deployment_info{{deployment="d",engine="vllm",image_digest="{IMAGE}",'
               f'kind="vllm",node="spark1",ranks="0,1",recipe="r",role="head"}}'] == 1
    assert got['sparkdeploy_deployment_since_timestamp_seconds{deployment="d",node="spark1"}'] == 1796666400
    assert got['sparkdeploy_node_memory_total_bytes{node="spark1"}'] == 127535616 * 1024
    assert got['sparkdeploy_node_memory_available_bytes{node="spark1"}'] == 98304000 * 1024
    assert got['sparkdeploy_link_receive_bytes_total{interface="enp1s0f0np0",node="spark1"}'] == 1000
    assert got['sparkdeploy_link_transmit_dropped_total{interface="enp1s0f0np0",node="spark1"}'] == 1007
    assert got['sparkdeploy_watchdog_restarts_total{engine="vllm",node="spark1",reason="nccl-hang"}'] == 2
    assert got['sparkdeploy_watchdog_restarts_total{engine="vllm",node="spark1",reason="unknown"}'] == 1
    assert got['sparkdeploy_watchdog_gave_up{engine="vllm",node="spark1"}'] == 0
    assert got['sparkdeploy_fabric_verdict{verdict="degraded"}'] == 1
    assert got['sparkdeploy_fabric_busbw_gbytes_per_second{bytes="1048576"}'] == 0.5
    assert got["sparkdeploy_fabric_expected_gbytes_per_second"] == 12.5
    assert got["sparkdeploy_bench_output_tokens_per_second"] == 27
    assert "sparkdeploy_bench_ttft_median_milliseconds" not in got  # not measured: no sample


def test_the_exporter_with_no_records_reports_the_node_alone(tmp_path):
    text = exporter_text(tmp_path, figures="not json")
    got = samples(text)
    assert [k for k in got if k.startswith(("sparkdeploy_deployment", "sparkdeploy_watchdog",
                                            "sparkdeploy_fabric", "sparkdeploy_bench"))] == []
    assert got['sparkdeploy_node_memory_total_bytes{node="spark1"}'] == 127535616 * 1024


def test_a_swap_of_another_deployment_is_not_this_ones(tmp_path):
    got = samples(exporter_text(tmp_path, deployment={"deployment": "d"},
                                swap={"phase": "done", "deployment": "other", "to_model": "x"}))
    assert not [k for k in got if k.startswith("sparkdeploy_swap_phase")]


def test_an_engine_name_that_would_leave_the_records_is_not_read(tmp_path):
    outside = tmp_path / "x.restarts.json"
    outside.write_text(json.dumps({"restarts": [{"class": "c", "outcome": "restarted"}]}))
    got = samples(exporter_text(tmp_path, deployment={"deployment": "d", "engine": "../../x"}))
    assert not [k for k in got if k.startswith("sparkdeploy_watchdog_restarts_total")]


def test_ss_lines_name_who_holds_each_port():
    class H:
        def run(self, argv, change=False):
            assert argv == ["ss", "-Hltnp"]
            return type("R", (), {"stdout": (
                'LISTEN 0 4096 0.0.0.0:9090 0.0.0.0:* users:(("prometheus",pid=7,fd=3))\n'
                "\n"
                "LISTEN 0 128 [::]:22 [::]:*\n"
                "LISTEN 0 511 127.0.0.1:9408 0.0.0.0:*\n")})()

    assert step.listening(H()) == {9090: "prometheus", 22: "another program", 9408: "another program"}


def test_the_rules_and_the_dashboard_speak_of_the_same_series():
    from sparkdeploy.core import packaged

    rules = yaml.safe_load(packaged.data(mx.RULES).read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"]}
    dash = json.loads(packaged.data(mx.DASHBOARD).read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {w for e in exprs for w in __import__("re").findall(r"sparkdeploy:[a-z0-9_:]+", e)}
    assert used and used <= recorded  # every rule a panel reads exists
    assert recorded - used == {"sparkdeploy:prompt_tokens:rate1m"} - used
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_a_bench_of_the_deployment_reaches_the_heads_figures_once_metrics_run(tmp_path, up_targets):
    from sparkdeploy.core.outcomes import Result

    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)

    def run_of(tok_s: float) -> list:
        return [Result("bench.run", Status.OK, "concurrency 1: ...", None, {"run": {"summary": {
            "output_tok_s": tok_s, "ttft_ms": {"median": 51.0}, "itl_ms": {"median": 36.5}}}})]

    before = len(ns["spark1"].ran)
    assert run_one(dep, "bench.figures", results=run_of(20.0)) == []  # no metrics yet: the record
    assert len(ns["spark1"].ran) == before
    run_one(dep, "metrics.up")
    assert json.loads(ns["spark1"].node_files[mx.FIGURES_FILE])["bench"]["output_tok_s"] == 20.0
    run = run_of(26.9)
    [r] = run_one(dep, "bench.figures", results=run)
    assert (r.status, r.why) == (Status.OK, "the figures are in the metrics (sparkdeploy_bench_*)")
    bench = json.loads(ns["spark1"].node_files[mx.FIGURES_FILE])["bench"]
    assert (bench["output_tok_s"], bench["ttft_ms_median"], bench["itl_ms_median"]) == (26.9, 51.0, 36.5)
    assert mx.FIGURES_FILE not in ns["spark2"].node_files


WRITE = ('umask 022 && mkdir -p -- "$(dirname -- "$1")" && cat > "$1.part" && chmod "$2" "$1.part" '
         '&& mv -f -- "$1.part" "$1"')


def said(ran: list[list[str]]) -> list:
    """The node's commands, a write (Host.put_file: readable by all, mode 0644) as (write, path)."""
    out = []
    for a in ran:
        if a[:3] == ["sh", "-c", WRITE]:
            assert a[5] == "0644", a
            out.append(("write", a[4]))
        elif a[:2] == ["sha256sum", "--"] or a[3:4] == ["ps"]:
            continue
        else:
            out.append(a)
    return out


UNITS = [mx.EXPORTER_UNIT, mx.PROMETHEUS_UNIT, mx.STATUS_UNIT]
SOCK = ["docker", "-H", "unix:///var/run/docker.sock"]


def test_metrics_up_on_the_head_and_a_worker_command_by_command(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    check = [*SOCK, "run", "--rm", "--network=none", "--entrypoint=python3", IMAGE, "-c",
             "import prometheus_client"]
    assert said(ns["spark1"].ran) == [
        ["sh", "-c", 'command -v -- "$1"', "sh", "prometheus"],
        ["systemctl", "is-active", "--", *UNITS], ["ss", "-Hltnp"], check,
        ["sh", "-c", 'for f; do [ -e "$f" ] && echo "$f"; done; true', "sh",
         f"{mx.UNIT_DIR}/sparkdeploy-gateway.service"],
        ("write", f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}"), ("write", mx.PROGRAM_FILE),
        ("write", mx.DEPLOYMENT_FILE), ("write", mx.FIGURES_FILE), ("write", mx.CONFIG),
        ("write", mx.RULES_FILE), ("write", f"{mx.UNIT_DIR}/{mx.PROMETHEUS_UNIT}"),
        ("write", mx.STATUS_FILE), ("write", f"{mx.UNIT_DIR}/{mx.STATUS_UNIT}"),
        ["systemctl", "daemon-reload"], ["systemctl", "is-active", "--", *UNITS],
        *(["systemctl", "start", "--", u] for u in UNITS)]
    assert said(ns["spark2"].ran) == [
        ["systemctl", "is-active", "--", mx.EXPORTER_UNIT], ["ss", "-Hltnp"], check,
        ("write", f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}"), ("write", mx.PROGRAM_FILE),
        ("write", mx.DEPLOYMENT_FILE), ["systemctl", "daemon-reload"],
        ["systemctl", "is-active", "--", mx.EXPORTER_UNIT],
        ["systemctl", "start", "--", mx.EXPORTER_UNIT]]
    head = ns["spark1"].node_files
    assert head[f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}"] == (
        "[Unit]\nDescription=sparkdeploy metrics exporter of qwen3.5-122b-a10b-fp8 on spark1\n"
        "Wants=docker.service network-online.target\nAfter=docker.service network-online.target\n\n"
        "[Service]\nType=simple\n"
        "ExecStart=/usr/bin/docker -H unix:///var/run/docker.sock run --rm --name=sparkdeploy-exporter "
        "--network=host --read-only --volume=/var/lib/sparkdeploy-node:/sparkdeploy:ro "
        f"--entrypoint=python3 {IMAGE} /sparkdeploy/metrics/metrics_exporter.py --listen=0.0.0.0:9408 "
        "--node=spark1 --state=/sparkdeploy --interface=enp1s0f0np0\n"
        "ExecStop=/usr/bin/docker -H unix:///var/run/docker.sock rm --force sparkdeploy-exporter\n"
        "Restart=on-failure\nRestartSec=5\nTimeoutStopSec=30\n\n[Install]\nWantedBy=multi-user.target\n")
    assert head[f"{mx.UNIT_DIR}/{mx.PROMETHEUS_UNIT}"].startswith(
        "[Unit]\nDescription=sparkdeploy Prometheus of qwen3.5-122b-a10b-fp8 on spark1\n")
    assert head[f"{mx.UNIT_DIR}/{mx.STATUS_UNIT}"].startswith(
        "[Unit]\nDescription=sparkdeploy status page of qwen3.5-122b-a10b-fp8 on spark1\n")
    assert "\nExecStop" not in head[f"{mx.UNIT_DIR}/{mx.STATUS_UNIT}"]
    assert head[mx.CONFIG] == (
        "# written by sparkdeploy's metrics.up; serve.down removes it\n"
        "global:\n  scrape_interval: 15s\n  evaluation_interval: 15s\n  external_labels:\n"
        "    deployment: qwen3.5-122b-a10b-fp8\nrule_files:\n- /var/lib/sparkdeploy-node/metrics/rules.yml\n"
        "scrape_configs:\n- job_name: engine\n  metrics_path: /metrics\n  static_configs:\n"
        "  - targets:\n    - 192.168.1.11:8000\n    labels:\n      sparkdeploy_engine: vllm\n"
        "- job_name: sparkdeploy\n  honor_labels: true\n  static_configs:\n  - targets:\n    - 192.168.1.11:9408\n"
        "    labels:\n      node: spark1\n  - targets:\n    - 192.168.1.12:9408\n    labels:\n"
        "      node: spark2\n")
    from sparkdeploy.core import packaged

    assert head[mx.RULES_FILE] == packaged.data(mx.RULES).read_text()
    assert head[mx.PROGRAM_FILE] == packaged.data(mx.EXPORTER).read_text()
    assert head[mx.STATUS_FILE] == packaged.helper(mx.STATUS_PAGE).read_text()
    assert json.loads(head[mx.FIGURES_FILE]) == {}  # no fabric test, no bench recorded


@pytest.mark.parametrize("case, want", [
    ("prometheus-port", ["spark1: port 9090 is held by prometheus (metrics.port)"]),
    ("status-port", ["spark1: port 9480 is held by grafana (metrics.status_port)"]),
    ("both", ["spark1: port 9090 is held by prometheus (metrics.port)",
              "spark1: port 9480 is held by grafana (metrics.status_port)"]),
    ("worker-status-port", []),  # the status page runs on the head only
    ("no-engine-on-worker", ["spark2: no engine container of qwen3.5-122b-a10b-fp8 runs here (the "
                             "exporter runs in the serving image)"]),
])
def test_each_port_and_node_is_checked(tmp_path, up_targets, case, want):
    ns = nodes()
    ns["spark1"].units[mx.EXPORTER_UNIT] = "active"  # its own port held: the others still checked
    ns["spark1"].listening[9408] = "python3"
    if case in ("prometheus-port", "both"):
        ns["spark1"].listening[9090] = "prometheus"
    if case in ("status-port", "both"):
        ns["spark1"].listening[9480] = "grafana"
    if case == "worker-status-port":
        ns["spark2"].listening.update({9480: "grafana", 9090: "prometheus"})
    if case == "no-engine-on-worker":
        ns["spark2"].containers.clear()
    dep, _ = dep_of(tmp_path, ns)
    results = run_one(dep, "metrics.up")
    assert [r.why for r in results if r.failed] == want
    if want:
        assert all(not n.node_files for n in ns.values())


def test_with_the_prometheus_image_the_head_must_hold_it(tmp_path, up_targets):
    ns = nodes()
    ns["spark1"].programs.clear()  # no package needed
    dep, _ = dep_of(tmp_path, ns)
    dep.profile = dep.profile.model_copy(update={"metrics": dep.profile.metrics.model_copy(
        update={"prometheus": "image"})})
    [r] = run_one(dep, "metrics.up")
    assert (r.status, r.why) == (Status.FAILED, "spark1: no image prom/prometheus:v3.7.3 (docker pull "
                                                "it; metrics.prometheus_image)")
    assert [*SOCK, "image", "inspect", "--format", "{{json .}}", "prom/prometheus:v3.7.3"] in ns["spark1"].ran
    ns["spark1"].images = {"prom/prometheus:v3.7.3"}
    results = run_one(dep, "metrics.up")
    assert results[-2].why == "metrics: http://192.168.1.11:9090 (3 targets up)"
    unit = ns["spark1"].node_files[f"{mx.UNIT_DIR}/{mx.PROMETHEUS_UNIT}"]
    assert ("\nExecStop=/usr/bin/docker -H unix:///var/run/docker.sock rm --force sparkdeploy-prometheus\n"
            in unit)


def test_a_unit_that_does_not_start_fails_the_step_naming_it(tmp_path, up_targets):
    ns = nodes()
    ns["spark2"].fail_start.add(mx.EXPORTER_UNIT)
    dep, _ = dep_of(tmp_path, ns)
    results = run_one(dep, "metrics.up")
    assert outcome(results) == (
        Status.FAILED, "spark2: systemctl start sparkdeploy-exporter.service: Job for "
                       "sparkdeploy-exporter.service failed.")


def test_a_dry_run_still_refuses_a_port_another_program_holds(tmp_path, up_targets):
    ns = nodes()
    ns["spark1"].listening[9090] = "prometheus"
    dep, _ = dep_of(tmp_path, ns, dry=True)
    assert [r.why for r in run_one(dep, "metrics.up") if r.failed] == [
        "spark1: port 9090 is held by prometheus (metrics.port)"]


def test_containers_without_a_start_label_have_no_since(tmp_path):
    from sparkdeploy.core.labels import Container

    dep, _ = dep_of(tmp_path, nodes())
    c = Container("1", "h", "running", "", deployment="qwen3.5-122b-a10b-fp8", engine="vllm", port=8000)
    assert mx.serving_from(dep, {"spark1": [c]}).since is None


def test_a_dry_run_writes_and_starts_nothing(tmp_path, up_targets):
    ns = nodes()
    dep, ctx = dep_of(tmp_path, ns, dry=True)
    results = run_one(dep, "metrics.up")
    assert results[-1].why.startswith("would start sparkdeploy-exporter.service, "
                                      "sparkdeploy-prometheus.service, sparkdeploy-status.service on spark1")
    assert all(not n.node_files for n in ns.values())
    assert not [a for n in ns.values() for a in n.ran if a[:1] == ["systemctl"] and a[1] != "is-active"]
    assert up_targets == []


def test_serve_down_removes_the_metrics_with_the_engine(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    for n in ns.values():
        n.ran.clear()
    assert mx.remove(dep, dep.host("spark1")) == UNITS
    assert said(ns["spark1"].ran) == [
        ["sh", "-c", 'for f; do [ -e "$f" ] && echo "$f"; done; true', "sh",
         *(f"{mx.UNIT_DIR}/{u}" for u in UNITS)],
        *(["systemctl", "stop", "--", u] for u in UNITS),
        ["rm", "-f", "--", *(f"{mx.UNIT_DIR}/{u}" for u in UNITS), mx.CONFIG, mx.RULES_FILE,
         mx.DEPLOYMENT_FILE, mx.FIGURES_FILE, mx.PROGRAM_FILE, mx.STATUS_FILE],
        ["systemctl", "daemon-reload"]]
    assert ns["spark1"].node_files == {}
    assert mx.remove(dep, dep.host("spark1")) == []


def test_what_changes_a_node_goes_through_sudo_and_what_reads_does_not(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    mx.remove(dep, dep.host("spark1"))
    head = ns["spark1"]
    changing = [a for a in head.ran if a[:2] in (["systemctl", "start"], ["systemctl", "stop"],
                                                  ["systemctl", "daemon-reload"])
                or a[:1] == ["rm"] or a[:3] == ["sh", "-c", WRITE]]
    assert len(changing) == 9 + 3 + 1 + 3 + 1 + 1 and changing == [a for a in head.sudo if a in changing]
    assert [a for a in head.sudo if a not in changing] == [a for a in head.sudo if a[:1] == ["sha256sum"]]


def test_restarts_follow_what_changed(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    head = ns["spark1"]

    def again() -> list:
        head.ran.clear()
        run_one(dep, "metrics.up")
        return [a for a in head.ran if a[:1] == ["systemctl"] and a[1] != "is-active"]

    head.node_files[mx.PROGRAM_FILE] = "an older exporter"
    assert again() == [["systemctl", "restart", "--", mx.EXPORTER_UNIT]]
    head.node_files[mx.STATUS_FILE] = "an older page"
    assert again() == [["systemctl", "restart", "--", mx.STATUS_UNIT]]
    head.node_files[f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}"] = "an older unit"
    assert again() == [["systemctl", "daemon-reload"], ["systemctl", "restart", "--", mx.EXPORTER_UNIT]]
    head.node_files[f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}"] = "an older unit"
    head.node_files[mx.PROGRAM_FILE] = "an older exporter"
    assert again() == [["systemctl", "daemon-reload"], ["systemctl", "restart", "--", mx.EXPORTER_UNIT]]
    head.node_files[f"{mx.UNIT_DIR}/{mx.PROMETHEUS_UNIT}"] = "an older unit"
    assert again() == [["systemctl", "daemon-reload"], ["systemctl", "restart", "--", mx.PROMETHEUS_UNIT]]
    head.node_files[f"{mx.UNIT_DIR}/{mx.STATUS_UNIT}"] = "an older unit"
    assert again() == [["systemctl", "daemon-reload"], ["systemctl", "restart", "--", mx.STATUS_UNIT]]
    head.node_files[mx.DEPLOYMENT_FILE] = "{}"  # read at each scrape: nothing restarts
    head.node_files[mx.FIGURES_FILE] = "{}"
    assert again() == []
    assert json.loads(head.node_files[mx.DEPLOYMENT_FILE])["role"] == "head"
    head.units[mx.STATUS_UNIT] = "failed"  # a unit that died is started again
    assert again() == [["systemctl", "start", "--", mx.STATUS_UNIT]]


def test_the_heads_figures_come_from_the_records(tmp_path, up_targets):
    from sparkdeploy.core.records import BenchFigures, FabricRecord, FabricSize

    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    dep.records.write(FabricRecord(verdict="ok", expected_gbs=12.5, why="w", sizes=[
        FabricSize(bytes=1048576, algbw_gbs=0.5, busbw_gbs=0.5)]))
    dep.records.write(BenchFigures(output_tok_s=27.0, ttft_ms_median=50.0, itl_ms_median=36.0, time=9.0))
    run_one(dep, "metrics.up")
    assert ns["spark1"].node_files[mx.FIGURES_FILE] == (
        '{"bench": {"itl_ms_median": 36.0, "output_tok_s": 27.0, "time": 9.0, "ttft_ms_median": 50.0}, '
        '"fabric": {"expected_gbs": 12.5, "sizes": [{"busbw_gbs": 0.5, "bytes": 1048576}], '
        '"verdict": "ok"}}\n')
    assert ns["spark2"].node_files[mx.DEPLOYMENT_FILE] == (
        '{"deployment": "qwen3.5-122b-a10b-fp8", "engine": "vllm", "image_digest": "' + IMAGE + '", '
        '"kind": "vllm", "ranks": "1", "recipe": "qwen3.5-122b", "role": "worker", "since": 1796666400.0}\n')
    # a head without the metrics' figures (metrics.down ran since): the bench is recorded alone
    del ns["spark1"].node_files[mx.FIGURES_FILE]
    assert run_one(dep, "bench.figures", results=[]) == []
    assert mx.publish(dep, "{}\n") is False and mx.FIGURES_FILE not in ns["spark1"].node_files


def test_a_prometheus_that_is_no_path_is_none(tmp_path, up_targets):
    ns = nodes()
    ns["spark1"].programs["prometheus"] = "prometheus: aliased to prom"
    dep, _ = dep_of(tmp_path, ns)
    assert run_one(dep, "metrics.up")[0].why.startswith("spark1: no prometheus on the PATH")


def test_ready_says_what_prometheus_has_not_got(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "page_up", lambda url: True)
    monkeypatch.setattr(step, "targets", lambda url: [
        step._Target(scrapeUrl="http://a/metrics", health="down"),
        step._Target(scrapeUrl="http://b/metrics")])
    ns = nodes()
    ctx = Ctx(ns)
    clock = FakeClock()
    dep = deployment(SEED, tmp_path / "state", ctx, clock=clock)
    assert run_one(dep, "metrics.up")[-1].why.endswith(
        "not ready after 90 s: http://a/metrics down; http://b/metrics unknown")
    assert set(clock.sleeps) == {1}  # a probe a second
    monkeypatch.setattr(step, "targets", lambda url: [step._Target(scrapeUrl="http://a/metrics",
                                                                   health="up")])
    assert run_one(dep, "metrics.up")[-1].why.endswith("not ready after 90 s: 1 of 3 targets")
    monkeypatch.setattr(step, "targets", lambda url: [])
    assert run_one(dep, "metrics.up")[-1].why.endswith(
        "not ready after 90 s: http://192.168.1.11:9090 does not answer")


def test_metrics_down_in_a_dry_run_says_what_it_would_remove(tmp_path, up_targets):
    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    run_one(dep, "metrics.up")
    dry, _ = dep_of(tmp_path, ns, dry=True)
    results = run_one(dry, "metrics.down")
    assert [(r.node, r.why) for r in results if r.why.startswith("would")] == [
        ("spark1", "would stop and remove sparkdeploy-exporter.service, sparkdeploy-prometheus.service, "
                   "sparkdeploy-status.service"),
        ("spark2", "would stop and remove sparkdeploy-exporter.service")]
    assert ns["spark1"].units[mx.EXPORTER_UNIT] == "active"


def test_what_serves_is_read_from_this_deployments_running_containers(tmp_path, monkeypatch):
    from sparkdeploy.core.labels import Container

    ns = nodes()
    dep, _ = dep_of(tmp_path, ns)
    mine = dict(deployment="qwen3.5-122b-a10b-fp8", engine="vllm", kind="vllm", recipe="r")
    head = Container("1", "h", "running", "", role="head", rank=0, port=8000, image_id="sha256:h",
                     started="2026-12-07T18:00:10Z", **mine)
    other = Container("2", "o", "running", "", deployment="another", engine="vllm", port=9000,
                      image_id="sha256:o", started="2026-12-07T17:00:00Z")
    stopped = Container("3", "w", "exited", "", role="worker", image_id="sha256:w",
                        started="2026-12-07T17:00:00Z", **mine)
    fresh = Container("4", "w2", "running", "", role="worker", rank=2, **mine)
    also = Container("5", "w1", "running", "", role="worker1", rank=1, **mine)
    s = mx.serving_from(dep, {"spark1": [other, head], "spark2": [stopped, fresh, also]})
    assert s == mx.Serving(engine="vllm", kind="vllm", recipe="r", engine_url="http://192.168.1.11:8000",
                           images={"spark1": "sha256:h"}, since=1796666410.0,
                           ranks={"spark1": "0", "spark2": "1,2"})
    assert mx.serving_from(dep, {"spark1": [other], "spark2": [stopped]}) is None
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    __import__("time").tzset()
    try:
        assert mx.epoch("1970-01-01T00:00:10Z") == 10.0 and mx.epoch("yesterday") is None
    finally:
        monkeypatch.delenv("TZ")
        __import__("time").tzset()
    assert mx.target("http://10.0.0.1:9408/") == "10.0.0.1:9408" == mx.target("10.0.0.1:9408")
