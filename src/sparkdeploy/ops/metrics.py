"""Metrics an owner can scrape: Prometheus on the head and sparkdeploy's exporter on every node,
each a systemd unit (``metrics.up`` starts them, ``serve.down`` and ``metrics.down`` remove them).

On the nodes, under ``/var/lib/sparkdeploy-node/metrics/`` (the node's records: no secret):

- every node: ``metrics_exporter.py`` (``sparkdeploy/data/``) and ``deployment.json`` (what the
  exporter reports of the deployment); the unit ``sparkdeploy-exporter.service`` runs the
  program in the serving image (``docker run --rm --network=host --read-only``, the node's
  records mounted read-only), where ``prometheus_client`` is already installed;
- the head: ``prometheus.yml`` (scraping the engine's ``/metrics`` and every exporter),
  ``rules.yml`` (``sparkdeploy/data/metrics/rules.yml``: the recording rules), ``figures.json``
  (the last fabric test and bench), ``tsdb/`` (what Prometheus keeps; left by ``serve.down``: the
  history outlives a deployment), and the unit ``sparkdeploy-prometheus.service``: the head's own
  ``prometheus`` (``metrics.prometheus: package``) or Prometheus' image (``image``).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import yaml

from sparkdeploy.core import labels
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.records import BenchFigures, FabricRecord
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NODE_STATE, read_node_file, write_node_file
from sparkdeploy.ops.serve_containers import UNIT_DIR, unit_files
from sparkdeploy.profile.config import Metrics

NODE_DIR = f"{NODE_STATE}/metrics"
PROMETHEUS_UNIT = "sparkdeploy-prometheus.service"
STATUS_UNIT = "sparkdeploy-status.service"
STATUS_PAGE = "status_page.py"
"""The status page (``sparkdeploy/helpers/``, standard library only: the head's python3 runs it)."""
PYTHON = "/usr/bin/python3"
EXPORTER_UNIT = "sparkdeploy-exporter.service"
EXPORTER_CONTAINER = "sparkdeploy-exporter"
PROMETHEUS_CONTAINER = "sparkdeploy-prometheus"
EXPORTER = "metrics_exporter.py"
"""The exporter program (``sparkdeploy/data/``)."""
RULES = "metrics/rules.yml"
"""The recording rules (``sparkdeploy/data/``)."""
DASHBOARD = "metrics/dashboard.json"
"""The Grafana dashboard (``sparkdeploy/data/``)."""
IN_CONTAINER = "/sparkdeploy"
"""Where the exporter's container sees the node's records (read-only)."""
DOCKER = "/usr/bin/docker"
"""The docker CLI a unit runs (an ExecStart names its program by its path)."""
CONFIG = f"{NODE_DIR}/prometheus.yml"
RULES_FILE = f"{NODE_DIR}/rules.yml"
TSDB = f"{NODE_DIR}/tsdb"
DEPLOYMENT_FILE = f"{NODE_DIR}/deployment.json"
FIGURES_FILE = f"{NODE_DIR}/figures.json"
PROGRAM_FILE = f"{NODE_DIR}/{EXPORTER}"
STATUS_FILE = f"{NODE_DIR}/{STATUS_PAGE}"


class MetricsFailed(StepFailed):
    """A metrics unit that did not start, or a Prometheus that never scraped every target."""


def units(dep: Deployment, node: str) -> list[str]:
    """The metrics units a node runs: the exporter everywhere, Prometheus and the status page on
    the head too."""
    return [EXPORTER_UNIT, *([PROMETHEUS_UNIT, STATUS_UNIT] if node == dep.profile.head.name else [])]


def url(dep: Deployment) -> str:
    """Prometheus' address as the controller (and an owner's browser) reaches it."""
    return ep.engine_url(dep.host(dep.profile.head.name), dep.profile.metrics.port)


def status_url(dep: Deployment) -> str:
    """The status page's address."""
    return ep.engine_url(dep.host(dep.profile.head.name), dep.profile.metrics.status_port)


def target(url_: str) -> str:
    """``host:port`` of an ``http://host:port`` address (a Prometheus scrape target)."""
    return url_.split("://", 1)[-1].rstrip("/")


def epoch(stamp: str) -> float | None:
    """A container's ``started`` label (``2026-12-07T18:00:00Z``) as Unix time."""
    try:
        return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


# --- what goes on the nodes ------------------------------------------------------------------

def prometheus_config(m: Metrics, deployment: str, engine: str, engine_target: str,
                      exporters: dict[str, str], gateway: str | None = None) -> str:
    """``prometheus.yml``: the engine's ``/metrics`` (``engine_target``, ``host:port``), each
    node's exporter (``{node: host:port}``) and, while ``serve.add`` has placed models, the
    gateway's per-model figures (``gateway``, ``host:port``), every ``scrape_s``, the recording
    rules loaded."""
    interval = f"{m.scrape_s:g}s"
    doc = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "external_labels": {"deployment": deployment}},
        "rule_files": [RULES_FILE],
        "scrape_configs": [
            {"job_name": "engine", "metrics_path": "/metrics",
             "static_configs": [{"targets": [engine_target], "labels": {"sparkdeploy_engine": engine}}]},
            # the exporter names its node itself: its label is kept (not exported_node)
            {"job_name": "sparkdeploy", "honor_labels": True,
             "static_configs": [{"targets": [t], "labels": {"node": n}}
                                for n, t in exporters.items()]},
            *([{"job_name": "gateway", "static_configs": [{"targets": [gateway]}]}] if gateway else []),
        ],
    }
    return "# written by sparkdeploy's metrics.up; serve.down removes it\n" + yaml.safe_dump(
        doc, sort_keys=False, default_flow_style=False)


def prometheus_flags(m: Metrics) -> list[str]:
    return [f"--config.file={CONFIG}", f"--storage.tsdb.path={TSDB}",
            f"--storage.tsdb.retention.time={m.retention_days}d",
            f"--web.listen-address=0.0.0.0:{m.port}"]


def prometheus_start(dep: Deployment, binary: str | None) -> list[str]:
    """The Prometheus unit's ExecStart: the head's own binary, or Prometheus' image run as root
    (the records' directory is root's) on the host's network."""
    m = dep.profile.metrics
    if m.prometheus == "package":
        assert binary is not None
        return [binary, *prometheus_flags(m)]
    head = dep.host(dep.profile.head.name)
    return [DOCKER, "-H", f"unix://{head.node.docker_socket}", "run", "--rm",
            f"--name={PROMETHEUS_CONTAINER}", "--network=host", "--user=0",
            f"--volume={NODE_DIR}:{NODE_DIR}", m.prometheus_image, *prometheus_flags(m)]


def exporter_start(host: Host, image: str, listen_port: int) -> list[str]:
    """The exporter unit's ExecStart: the program in the serving image (by ID), read-only, the
    node's records mounted read-only, on the host's network."""
    node = host.node
    return [DOCKER, "-H", f"unix://{node.docker_socket}", "run", "--rm",
            f"--name={EXPORTER_CONTAINER}", "--network=host", "--read-only",
            f"--volume={NODE_STATE}:{IN_CONTAINER}:ro",
            "--entrypoint=python3", image,
            f"{IN_CONTAINER}/metrics/{EXPORTER}", f"--listen=0.0.0.0:{listen_port}",
            f"--node={host.name}", f"--state={IN_CONTAINER}", f"--interface={node.link.interface}"]


def status_start(m: Metrics) -> list[str]:
    """The status page unit's ExecStart: the head's python3, Prometheus on the head itself."""
    return [PYTHON, STATUS_FILE, f"--listen=0.0.0.0:{m.status_port}",
            f"--prometheus=http://127.0.0.1:{m.port}", f"--state={NODE_STATE}"]


def container_stop(host: Host, name: str) -> list[str]:
    return [DOCKER, "-H", f"unix://{host.node.docker_socket}", "rm", "--force", name]


@dataclass(frozen=True)
class Serving:
    """What the exporter and Prometheus are told of the deployment, read from its containers."""

    engine: str
    kind: str
    recipe: str
    engine_url: str
    images: dict[str, str]
    """{node: the image ID its engine container runs}"""
    since: float | None
    ranks: dict[str, str] = dataclass_field(default_factory=dict)
    """{node: the engine's ranks there, as its containers' labels say ("0", "1,2")}"""


def deployment_json(dep: Deployment, s: Serving, node: str) -> str:
    """``deployment.json``: names and times only (never an engine's environment or a key)."""
    roles = "head" if node == dep.profile.head.name else "worker"
    return json.dumps({"deployment": dep.profile.name, "recipe": s.recipe, "engine": s.engine,
                       "kind": s.kind, "image_digest": s.images.get(node, ""), "role": roles,
                       "ranks": s.ranks.get(node, ""), "since": s.since}, sort_keys=True) + "\n"


def figures_json(fabric: dict[str, Any] | None, bench: dict[str, Any] | None) -> str:
    """``figures.json``: the last fabric test (verdict, expected, bus bandwidth per size) and the
    last bench (output tok/s, median TTFT and ITL), as numbers and short words."""
    out: dict[str, Any] = {}
    if fabric:
        out["fabric"] = {"verdict": fabric.get("verdict"), "expected_gbs": fabric.get("expected_gbs"),
                         "sizes": [{"bytes": s.get("bytes"), "busbw_gbs": s.get("busbw_gbs")}
                                   for s in fabric.get("sizes") or []]}
    if bench:
        out["bench"] = {k: bench.get(k) for k in ("output_tok_s", "ttft_ms_median", "itl_ms_median",
                                                 "time")}
    return json.dumps(out, sort_keys=True) + "\n"


def serving_from(dep: Deployment, on_nodes: dict[str, list[labels.Container]]) -> Serving | None:
    """The deployment's running engine as its containers' labels say (None: none runs)."""
    mine = [(n, c) for n, cs in on_nodes.items() for c in cs
            if c.deployment == dep.profile.name and c.running]
    with_port = next(((n, c) for n, c in mine if c.port), None)
    if with_port is None:
        return None
    node, api = with_port
    engine = [(n, c) for n, c in mine if c.engine == api.engine]
    starts = [t for t in (epoch(c.started) for _, c in engine) if t is not None]
    ranks: dict[str, set[int]] = {}
    for n, c in engine:
        if c.rank is not None:
            ranks.setdefault(n, set()).add(c.rank)
    return Serving(engine=api.engine, kind=api.kind, recipe=api.recipe,
                   engine_url=ep.engine_url(dep.host(node), api.port or 0),
                   images={n: c.image_id for n, c in engine if c.image_id},
                   since=min(starts) if starts else None,
                   ranks={n: ",".join(map(str, sorted(r))) for n, r in ranks.items()})


def remove(dep: Deployment, host: Host) -> list[str]:
    """Stop the node's metrics units (their ExecStop removes the containers) and remove them and
    the files they ran; the history (``tsdb/``) stays. The units that were there."""
    present = unit_files(host, units(dep, host.name))
    if not present:
        return []
    for u in present:
        host.run(["systemctl", "stop", "--", u], sudo=True, timeout=60)
    host.run(["rm", "-f", "--", *(f"{UNIT_DIR}/{u}" for u in present), CONFIG, RULES_FILE,
              DEPLOYMENT_FILE, FIGURES_FILE, PROGRAM_FILE, STATUS_FILE], sudo=True)
    host.run(["systemctl", "daemon-reload"], sudo=True)
    return present


def figures(dep: Deployment) -> str:
    """``figures.json`` from the controller's records: the last fabric test and bench."""
    fab = dep.records.read(FabricRecord)
    bench = dep.records.read(BenchFigures)
    return figures_json(fab.model_dump(mode="json") if fab else None,
                        bench.model_dump(mode="json") if bench else None)


def publish(dep: Deployment, figures: str) -> bool:
    """``figures.json`` on the head when the metrics run there (its file is there); True when
    written. The exporter reads it at the next scrape."""
    head = dep.host(dep.profile.head.name)
    if read_node_file(head, FIGURES_FILE) is None:
        return False
    write_node_file(head, FIGURES_FILE, figures)
    return True
