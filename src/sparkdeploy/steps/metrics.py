"""``metrics.up`` / ``metrics.down``: Prometheus on the head and sparkdeploy's exporter on every
node, around the deployment that serves (``sparkdeploy.ops.metrics`` says what goes where).

``metrics.up`` reads what serves from the engine containers' labels (a controller that did not
run ``serve.up`` finds it too), refuses before it writes anything (no ``prometheus`` on the head,
a port another program holds, a serving image without ``prometheus_client``), writes the
programs, the configuration and the units, (re)starts what changed and waits until Prometheus
has scraped every target once and the status page (``helpers/status_page.py``) answers. A re-run
with nothing changed restarts nothing. Its last lines are ``metrics: URL`` and ``status: URL``.
``serve.down`` removes the units with the engine (``mx.remove``), as ``metrics.down`` does alone.
"""

from __future__ import annotations

from pydantic import BaseModel

from sparkdeploy.core import packaged
from sparkdeploy.core.outside import OutsideError, request
from sparkdeploy.core.records import MetricsRecord
from sparkdeploy.core.wait import WaitTimeout, wait_for
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import docker, inspect_image
from sparkdeploy.ops import gateway as gw
from sparkdeploy.ops import metrics as mx
from sparkdeploy.ops.serve import put_file
from sparkdeploy.ops.serve_containers import active, ours, unit_files
from sparkdeploy.ops.units import listening, service_unit
from sparkdeploy.steps.registry import StepContext, step

STEP_UP = "metrics.up"
STEP_DOWN = "metrics.down"
READY_S = 60.0
"""How long Prometheus may take, after its start, to have scraped every target once (beside
two scrape intervals)."""
IMPORT_CHECK = "import prometheus_client"


class _Target(BaseModel):
    scrapeUrl: str = ""  # noqa: N815 (Prometheus' own key)
    health: str = ""
    lastError: str = ""  # noqa: N815
    labels: dict[str, str] = {}


class _Targets(BaseModel):
    activeTargets: list[_Target] = []  # noqa: N815


class _TargetsAnswer(BaseModel):
    status: str
    data: _Targets = _Targets()


def targets(url: str) -> list[_Target]:
    """Prometheus' active targets ([] when it does not answer)."""
    try:
        r = request("GET", f"{url}/api/v1/targets?state=active", deadline=5)
        return r.json(_TargetsAnswer, f"{url}/api/v1/targets").data.activeTargets if r.status == 200 else []
    except OutsideError:
        return []


def page_up(url: str) -> bool:
    """The status page answers its ``/health``."""
    try:
        return request("GET", f"{url}/health", deadline=5).status == 200
    except OutsideError:
        return False


def _which(host: Host, program: str) -> str | None:
    r = host.run(["sh", "-c", 'command -v -- "$1"', "sh", program], change=False)
    path = r.stdout.strip()
    return path if r.ok and path.startswith("/") else None


def _refusals(ctx: StepContext, s: mx.Serving, hosts: list[Host]) -> tuple[list[str], str | None]:
    """Why ``metrics.up`` must not start (one line each, nothing written yet), and the head's
    ``prometheus`` when the profile says ``package``."""
    dep = ctx.dep
    m = dep.profile.metrics
    head = dep.host(dep.profile.head.name)
    why: list[str] = []
    binary = None
    if m.prometheus == "package":
        binary = _which(head, "prometheus")
        if binary is None:
            why.append(f"{head.name}: no prometheus on the PATH (apt install prometheus; or "
                       "metrics.prometheus: image)")
    elif inspect_image(head, m.prometheus_image) is None:
        why.append(f"{head.name}: no image {m.prometheus_image} (docker pull it; metrics.prometheus_image)")

    def node(h: Host) -> list[str]:
        bad = []
        mine = active(h, mx.units(dep, h.name))
        held = listening(h)
        for port, unit, key in ((m.exporter_port, mx.EXPORTER_UNIT, "metrics.exporter_port"),
                                (m.port, mx.PROMETHEUS_UNIT, "metrics.port"),
                                (m.status_port, mx.STATUS_UNIT, "metrics.status_port")):
            if unit not in mx.units(dep, h.name) or port not in held or unit in mine:
                continue
            bad.append(f"{h.name}: port {port} is held by {held[port]} ({key})")
        image = s.images.get(h.name)
        if not image:
            bad.append(f"{h.name}: no engine container of {dep.profile.name} runs here "
                       "(the exporter runs in the serving image)")
        elif not dep.dry:
            r = h.run(docker(h, "run", "--rm", "--network=none", "--entrypoint=python3", image,
                             "-c", IMPORT_CHECK), change=False, timeout=120)
            if not r.ok:
                bad.append(f"{h.name}: the serving image {image[:19]} has no prometheus_client "
                           f"(the exporter runs in it): {r.one_line_error()}")
        return bad

    for lines in ctx.each(hosts, node, parallel=True):
        why += lines or []
    return why, binary


def _put(host: Host, path: str, content: str) -> bool:
    """A file of the node's records (readable by anyone, no previous version kept) unless it is
    already so; True when written."""
    return put_file(host, path, content, "0644", keep_previous=False, private=False)


def _write(dep: Deployment, s: mx.Serving, h: Host, binary: str | None,
           exporters: dict[str, str], gateway: str | None) -> tuple[list[str], bool]:
    """Everything of one node written; (units to restart because what they run changed, any
    unit file written)."""
    prof = dep.profile
    program = packaged.data(mx.EXPORTER).read_text()
    restart: list[str] = []
    unit_changed = False
    exp_unit = service_unit("metrics exporter", prof.name, h.name,
                            mx.exporter_start(h, s.images[h.name], prof.metrics.exporter_port),
                            mx.container_stop(h, mx.EXPORTER_CONTAINER))
    if _put(h, f"{mx.UNIT_DIR}/{mx.EXPORTER_UNIT}", exp_unit):
        restart.append(mx.EXPORTER_UNIT)
        unit_changed = True
    if _put(h, mx.PROGRAM_FILE, program) and mx.EXPORTER_UNIT not in restart:
        restart.append(mx.EXPORTER_UNIT)
    _put(h, mx.DEPLOYMENT_FILE, mx.deployment_json(dep, s, h.name))
    if h.name != prof.head.name:
        return restart, unit_changed
    _put(h, mx.FIGURES_FILE, mx.figures(dep))
    conf = mx.prometheus_config(prof.metrics, prof.name, s.engine, mx.target(s.engine_url), exporters,
                                gateway)
    changed_conf = _put(h, mx.CONFIG, conf)
    changed_conf = _put(h, mx.RULES_FILE, packaged.data(mx.RULES).read_text()) or changed_conf
    stop = (mx.container_stop(h, mx.PROMETHEUS_CONTAINER) if prof.metrics.prometheus == "image"
            else None)
    prom_unit = service_unit("Prometheus", prof.name, h.name, mx.prometheus_start(dep, binary), stop)
    if _put(h, f"{mx.UNIT_DIR}/{mx.PROMETHEUS_UNIT}", prom_unit):
        unit_changed = True
        restart.append(mx.PROMETHEUS_UNIT)
    elif changed_conf:
        restart.append(mx.PROMETHEUS_UNIT)
    page = _put(h, mx.STATUS_FILE, packaged.helper(mx.STATUS_PAGE).read_text())
    status_unit = service_unit("status page", prof.name, h.name, mx.status_start(prof.metrics))
    if _put(h, f"{mx.UNIT_DIR}/{mx.STATUS_UNIT}", status_unit):
        unit_changed = True
        restart.append(mx.STATUS_UNIT)
    elif page:
        restart.append(mx.STATUS_UNIT)
    return restart, unit_changed


def _start(h: Host, dep: Deployment, restart: list[str], reload: bool) -> list[str]:
    """Each metrics unit of the node running what its files say now; the units (re)started."""
    if reload:
        h.run(["systemctl", "daemon-reload"], sudo=True)
    wanted = mx.units(dep, h.name)
    running = active(h, wanted)
    done = []
    for u in wanted:
        if u in running and u not in restart:
            continue
        verb = "restart" if u in running else "start"
        r = h.run(["systemctl", verb, "--", u], sudo=True, timeout=120)
        if not r.ok:
            raise mx.MetricsFailed(f"{h.name}: systemctl {verb} {u}: {r.one_line_error()}")
        done.append(u)
    return done


def _ready(ctx: StepContext, url: str, want: int) -> list[_Target]:
    """Every target scraped and up, within ``READY_S`` and two scrape intervals."""
    last: list[_Target] = []
    page = mx.status_url(ctx.dep)

    def probe() -> list[_Target] | None:
        last[:] = targets(url)
        ok = len(last) == want and all(t.health == "up" for t in last)
        return list(last) if ok and page_up(page) else None

    def seen(_: object) -> str:
        if not last:
            return f"{url} does not answer"
        return "; ".join(f"{t.scrapeUrl} {t.health or 'unknown'}"
                         + (f" ({t.lastError})" if t.lastError else "") for t in last
                         if t.health != "up") or (
            f"{len(last)} of {want} targets" if len(last) != want
            else f"the status page {page} does not answer")

    dep = ctx.dep
    try:
        return wait_for(probe, deadline=READY_S + 2 * dep.profile.metrics.scrape_s, interval=1,
                        what="every target up", clock=dep.clock, sleep=dep.sleep,
                        describe=seen) or []
    except WaitTimeout as e:
        raise mx.MetricsFailed(f"the metrics at {url} are not ready after {e.waited:.0f} s: "
                               f"{e.last}") from None


@step(STEP_UP, needs=("serve.up",))
def up(ctx: StepContext) -> None:
    """Prometheus on the head and the exporter on every node, around what serves."""
    dep = ctx.dep
    prof = dep.profile
    if not prof.metrics.enabled:
        ctx.skipped("metrics.enabled is false in the profile")
        return
    hosts = [dep.host(n.name) for n in prof.nodes]
    found = ctx.each(hosts, lambda h: ours(h, prof.name), parallel=True)
    if any(f is None for f in found):
        return  # a node that cannot be reached: said, one line each
    s = mx.serving_from(dep, {h.name: f or [] for h, f in zip(hosts, found, strict=True)})
    if s is None:
        ctx.skipped(f"nothing of {prof.name} serves on the nodes (serve.up first)")
        return
    refused, binary = _refusals(ctx, s, hosts)
    if refused:
        for line in refused:
            ctx.failed(line)
        return
    url = mx.url(dep)
    exporters = {h.name: mx.target(ep.engine_url(h, prof.metrics.exporter_port)) for h in hosts}
    head = dep.host(prof.head.name)
    gateway = (mx.target(gw.url(dep)) if unit_files(head, [gw.UNIT]) else None)  # serve.add's
    written = ctx.each(hosts, lambda h: _write(dep, s, h, binary, exporters, gateway), parallel=True)
    if dep.dry:
        ctx.would(f"start {', '.join(mx.units(dep, prof.head.name))} on {prof.head.name}, "
                  f"{mx.EXPORTER_UNIT} on every node; metrics: {url}")
        return
    started: dict[str, list[str]] = {}
    for h, w in zip(hosts, written, strict=True):
        if w is None:
            return
        started[h.name] = _start(h, dep, *w)
    up_targets = _ready(ctx, url, 1 + len(hosts) + (gateway is not None))
    dep.records.write(MetricsRecord(
        url=url, targets=len(up_targets),
        units={h.name: mx.units(dep, h.name) for h in hosts},
        ports={h.name: [prof.metrics.exporter_port, *([prof.metrics.port, prof.metrics.status_port]
                                                       if h.name == prof.head.name else [])]
               for h in hosts}))
    what = "; ".join(f"{n}: {', '.join(u)}" for n, u in started.items() if u)
    line = f"metrics: {url} ({len(up_targets)} targets up)"
    status = mx.status_url(dep)
    if what:
        ctx.changed(f"started {what}", metrics=url)
        ctx.ok(line, metrics=url)
    else:
        ctx.ok(line + ", as it was", metrics=url)
    ctx.ok(f"status: {status}", status=status)


@step(STEP_DOWN)
def down(ctx: StepContext) -> None:
    """Stop and remove the metrics units and their files on every node (the history stays)."""
    dep = ctx.dep
    ctx.each([dep.host(n.name) for n in dep.profile.nodes], lambda h: _down_node(ctx, h))


def _down_node(ctx: StepContext, h: Host) -> None:
    gone = mx.remove(ctx.dep, h)
    if not gone:
        ctx.ok("no metrics unit", h.name)
    elif ctx.dep.dry:
        ctx.would(f"stop and remove {', '.join(gone)}", h.name)
    else:
        ctx.changed(f"stopped and removed {', '.join(gone)}", h.name)
