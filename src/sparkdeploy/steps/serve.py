"""Serving the model across the nodes: ``serve.up``, ``serve.down``, ``serve.status``,
``serve.logs``.

``serve.up`` tries the profile's engines in order (``--engine NAME`` starts with that one).
For each: its preflight on every node (a part of ``serve.up``: nothing is started when anything
is wrong), the image put on nodes that lack it (the ``image.ship`` step), then the engine's
stages started and waited on in phases, each bounded: containers running (one that exits fails
the engine at once, with its last lines), the SGLang or vLLM head's init port / Ray listing every node
with its GPU, the HTTP port open, ``/health``, ``/v1/models`` listing the model, one streamed
chat completion returning tokens. A phase with no new log line and no readiness step for ``serve.stall_s`` is a hang.

An engine that fails after starting is diagnosed from every container's log
(``sparkdeploy.engines.diagnose.classify``), its logs are saved under the run's directory
(``<state_dir>/runs/<time>-serve.up/``), its containers are removed on every node, and the
next engine is tried. The decision (engines tried, class, evidence, engine chosen, how long
from the hang's start to the fallback's start) goes into the ``serve`` record; the endpoint
into the ``endpoint`` record, where ``serve.status`` and ``bench.run`` find it. The last line
of a success is ``endpoint: http://<address>:<port>``.
"""

from __future__ import annotations

from typing import Any

from sparkdeploy.core import labels
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.records import Attempt, Endpoint, FabricRecord, ServeDecision, markdown_table
from sparkdeploy.engines import EngineError, launch
from sparkdeploy.engines.base import API_KEY_ENV
from sparkdeploy.engines.diagnose import classify
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NodeUnreachable, docker
from sparkdeploy.ops import gateway, metrics, serve_preflight
from sparkdeploy.ops.image import chosen, image_id
from sparkdeploy.ops.serve import (
    STEP_UP,
    Run,
    bring_up,
    ray_nodes,
    start,
    startup,
    startup_line,
)
from sparkdeploy.ops.serve_containers import (
    RAY_PROBE,
    Serving,
    active,
    installed,
    ours,
    remove,
    serving,
    stop_units,
    unit_files,
)
from sparkdeploy.ops.serve_watch import (
    EngineFailed,
    Stalled,
    Watch,
    describe,
    full_log,
    read_restarts,
)
from sparkdeploy.profile.config import Engine, ProfileError
from sparkdeploy.steps.registry import StepContext, step

STEP_DOWN = "serve.down"
STEP_STATUS = "serve.status"
STEP_LOGS = "serve.logs"

# --- one engine ---------------------------------------------------------------------------


def try_engine(ctx: StepContext, engine: Engine, run: Run) -> str | None:
    """Preflight, ship (the ``image.ship`` step), bring up one engine: the url, or None when it
    did not come up (said why). Raises EngineFailed."""
    dep = ctx.dep
    with ctx.failing(EngineError) as caught:
        draft = launch(dep.profile, engine, {}, bool(run.secrets))
    if caught.error is not None:
        return None
    pf = serve_preflight.check(ctx, engine, draft)
    if pf.problems:
        return None
    if pf.ship_to:
        shipped = ctx.call("image.ship", to=",".join(pf.ship_to), image=engine.image)
        if any(r.failed for r in shipped):
            return None
    lau = launch(dep.profile, engine, pf.facts, bool(run.secrets), image_id=pf.image_id,
                 image_digest=pf.image_digest)
    if dep.dry:
        for c in lau.containers:
            start(dep, dep.host(c.node), c, run.secrets)
        ctx.would(f"start {engine.name}: " + ", ".join(f"{c.name}@{c.node}" for c in lau.containers))
        return None
    watch = Watch(ctx, dep.profile.serve.stall_s, dep.profile.serve.poll_s)
    try:
        url = bring_up(dep, lau, run, watch)
        run.startup = startup(watch)
        return url
    except EngineFailed as e:
        e.watch = watch  # type: ignore[attr-defined]
        e.launch = lau  # type: ignore[attr-defined]
        raise


def give_up(dep: Deployment, engine: Engine, err: EngineFailed, run: Run) -> Attempt:
    """Diagnose from every container's log, save the logs, remove the containers everywhere."""
    watch: Watch | None = getattr(err, "watch", None)
    logs = watch.logs() if watch else {}
    logdir = run.save_logs(engine.name, logs)
    diag = classify(logs)
    hosts = [dep.host(n.name) for n in dep.profile.nodes]
    removed = remove(dep, hosts, engine.name)
    left = {h.name: [c.name for c in ours(h, dep.profile.name, engine.name)] for h in hosts}
    attempt = Attempt(engine=engine.name, outcome=err.kind, phase=err.phase, why=err.why,
                      diagnosis=diag.cls, summary=getattr(diag, "summary", ""),
                      evidence=[[e.label, e.line_no, e.text] for e in diag.evidence],
                      logs=str(logdir), removed=removed, left={n: c for n, c in left.items() if c})
    if watch and watch.marks:
        attempt.startup = startup(watch)
    if isinstance(err, Stalled):
        attempt.stall_s = dep.profile.serve.stall_s
        attempt.silent_s = round(err.silent_s, 1)
        attempt.hang_start = err.hang_start
    attempt.given_up_at = dep.clock()
    return attempt


def write_record(dep: Deployment, run: Run, chosen: str | None, url: str | None) -> None:
    rows = [[a.engine, a.outcome, a.diagnosis, a.phase,
             "; ".join(f"{e[0]}:{e[1]}: {e[2]}" for e in a.evidence[:3])]
            for a in run.attempts]
    md = markdown_table(["engine", "outcome", "class", "phase", "evidence"], rows) if rows else \
        "No engine failed."
    md += f"\n\nChosen: {chosen or 'none'}" + (f", serving at {url}" if url else "") + "\n"
    if chosen and run.startup:
        md += f"\n{chosen}: {startup_line(run.startup)}, from its start.\n"
    for a in run.attempts:
        if a.fallback_after_s is not None:
            md += (f"\n{a.engine}: {a.fallback_after_s:.1f}s from the hang's start (last "
                   f"output or readiness step) to starting the next engine.\n")
    dep.records.write(ServeDecision(tried=run.attempts, chosen=chosen, run_dir=str(run.dir),
                                    startup=run.startup if chosen else None),
                      markdown=md, title="serve.up: engine")


def _order(dep: Deployment, first: str | None) -> list[Engine]:
    engines = list(dep.profile.engines)
    if first is None:
        return engines
    names = [e.name for e in engines]
    if first not in names:
        raise ProfileError(f"--engine: no engine named {first!r} (engines: {', '.join(names)})")
    return engines[names.index(first):]


def record_endpoint(dep: Deployment, url: str, engine: str, keyed: bool) -> None:
    """The endpoint into the controller's cache (``bench.run`` and the run's last line read it)
    unless it holds just that already."""
    rec = ep.recorded(dep.records)
    env = API_KEY_ENV if keyed else None
    if rec and (rec.url, rec.engine, rec.model, rec.api_key_env) == (
            url, engine, dep.profile.model.repo, env):
        return
    dep.records.write(Endpoint(url=url, engine=engine, model=dep.profile.model.repo,
                               api_key_env=env))


def _before(ctx: StepContext, engines: list[Engine]) -> bool:
    """Already serving what the profile says, by the nodes' labels (ok), or run by persisted
    units (failed), or an engine's flags refused (failed, before anything is removed): True, said
    so; else clear this deployment's old containers, saying what differed. Unreachable nodes are
    left to the preflight to report."""
    dep = ctx.dep
    seen: list[Serving] = []
    for eng in engines:
        try:
            got = serving(dep, eng)
        except NodeUnreachable:
            continue
        if got.url:
            if not dep.dry:
                record_endpoint(dep, got.url, eng.name, bool(ep.api_key()))
            ctx.ok(f"{eng.name} serves as the profile says, since {got.since or '?'}",
                   engine=eng.name, since=got.since)
            ctx.ok(f"endpoint: {got.url}", endpoint=got.url, engine=eng.name)
            return True
        if got.why:
            seen.append(got)
    units: dict[str, list[str]] = {}
    reachable = []
    for h in (dep.host(n.name) for n in dep.profile.nodes):
        try:
            units[h.name] = active(h, installed(dep, h))
            reachable.append(h)
        except NodeUnreachable:
            continue
    if any(units.values()):
        ctx.failed("the persisted units run this deployment (" + "; ".join(
            f"{n}: {', '.join(u)}" for n, u in units.items() if u) + "): serve.down or "
            "serve.unpersist first")
        return True
    why = f" ({'; '.join(s.why for s in seen)})" if seen else ""
    if not serve_preflight.check_flags(ctx, engines, bool(ep.api_key())):
        return True  # refused before anything of the running deployment is removed
    if dep.dry:
        if seen:
            ctx.would(f"replace what the nodes run{why}")
        return False
    stale = remove(dep, reachable)
    if stale:
        ctx.changed("removed this deployment's old containers" + why + ": " + ", ".join(
            f"{n}: {', '.join(c)}" for n, c in stale.items()))
    return False


def _attempt(ctx: StepContext, eng: Engine, run: Run) -> str | None:
    """``try_engine``; anything but the engine failing (Ctrl-C, a node lost, a bug) removes
    what it started on every node it reaches before it goes on up."""
    try:
        return try_engine(ctx, eng, run)
    except EngineFailed:
        raise
    except BaseException:
        if not ctx.dep.dry:
            for h in (ctx.dep.host(n.name) for n in ctx.dep.profile.nodes):
                try:
                    remove(ctx.dep, [h], eng.name)
                except Exception:  # noqa: BLE001 - the first error is the one to show
                    continue
        raise


def model_and_image(dep: Deployment) -> dict[str, Any]:
    """The model path, repo and revision, and the image chosen by tag: with the engines and the
    nodes, a change to any of these redeploys the engine (a new revision is new weights)."""
    m = dep.profile.model
    return {"model.path": m.path, "model.repo": m.repo, "model.revision": m.revision,
            "image": chosen(dep).get("serve_image")}


def served_image_id(dep: Deployment) -> dict[str, Any]:
    """The chosen image by ID on the head (asks the head): a tag rebuilt redeploys the engine."""
    return {"image_id": image_id(dep, chosen(dep).get("serve_image"))}


@step(STEP_UP, needs=("link.check", "link.fabric", "services.stop", "image.ship", "model.verify"),
      fingerprint=Fingerprint("engines", "nodes", also=model_and_image, asks=served_image_id),
      redo=STEP_DOWN)
def up(ctx: StepContext, engine: str | None = None) -> None:
    """Bring the model up across the nodes, falling back to the next engine on a failure."""
    dep = ctx.dep
    engines = _order(dep, engine)
    if not serve_preflight.check_pins(ctx):  # before anything stops: a moved tag refuses
        return
    if _before(ctx, engines):
        return
    run = Run(dep)
    replaced: list[Result] = []  # engines that failed: the outcome only when none serves
    for i, eng in enumerate(engines):
        failure: EngineFailed | None = None
        try:
            url = _attempt(ctx, eng, run)
        except EngineFailed as e:  # this engine's failure: said below, then the next engine
            failure = e
        if failure is not None:
            attempt = give_up(dep, eng, failure, run)
            run.attempts.append(attempt)
            nxt = engines[i + 1].name if i + 1 < len(engines) else None
            ev = "; ".join(f"{a}:{b}: {c}" for a, b, c in attempt.evidence[:2])
            replaced.append(ctx.failed(
                f"{eng.name} {failure.kind}: {failure.why}; class: {attempt.diagnosis}"
                + (f" ({ev})" if ev else "") + (f"; falling back to {nxt}" if nxt else ""),
                diagnosis=attempt.diagnosis, evidence=attempt.evidence, engine=eng.name,
                logs=attempt.logs))
            if attempt.left:
                ctx.failed(f"containers left after removal: {attempt.left}")
                break
            if nxt and attempt.hang_start is not None:
                # the fallback starts now: the next engine's preflight
                attempt.fallback_after_s = round(dep.clock() - attempt.hang_start, 1)
            continue
        if url is None:
            if not dep.dry and run.attempts:
                write_record(dep, run, None, None)
            return
        write_record(dep, run, eng.name, url)
        record_endpoint(dep, url, eng.name, bool(run.secrets))
        tried = [a.engine for a in run.attempts]
        note = f" (after {', '.join(tried)} failed)" if tried else ""
        took = f"; {startup_line(run.startup)}" if run.startup else ""
        ctx.changed(f"{eng.name} serves {dep.profile.model.repo}{note}{took}", engine=eng.name,
                    tried=tried, fallback=bool(tried), endpoint=url,
                    diagnosis=run.attempts[-1].diagnosis if tried else None, startup=run.startup)
        ctx.ok(f"endpoint: {url}", endpoint=url, engine=eng.name)
        # the step succeeded: the engines it replaced stay in the stream and the record
        ctx.supersede(replaced)
        return
    write_record(dep, run, None, None)


# --- down, status, logs -------------------------------------------------------------------


@step(STEP_DOWN, needs=("serve.unpersist",))
def down(ctx: StepContext, keep_metrics: bool = False, keep_placed: bool = False) -> None:
    """Remove this deployment's engine containers and its metrics units on every node, and the
    models ``serve.add`` placed beside it with the gateway (``keep_metrics``: not the metrics; a
    swap's cut-over keeps Prometheus and its history running; ``keep_placed``: not the placed
    models, which a swap of the profile's own model leaves serving)."""
    dep = ctx.dep
    if not keep_placed and dep.profile.placement is None:
        ctx.call("serve.remove")  # every placed model, the gateway first
    ctx.each([dep.host(n.name) for n in dep.profile.nodes], lambda h: _down_node(ctx, h, keep_metrics))


def _down_node(ctx: StepContext, h: Host, keep_metrics: bool = False) -> None:
    dep = ctx.dep
    units = stop_units(dep, h) + ([] if keep_metrics else metrics.remove(dep, h))
    found = ours(h, dep.profile.name)
    if not found and not units:
        ctx.ok("no engine container", h.name)
        return
    names = [c.name for c in found]
    if names:
        h.run(docker(h, "rm", "--force", "--volumes", *names), timeout=120)
    what = ", ".join([*([f"stopped {', '.join(units)}"] if units else []), *names])
    if dep.dry:
        ctx.would(f"remove {what}", h.name)
        return
    left = ours(h, dep.profile.name)
    if left:
        ctx.failed("still there: " + ", ".join(c.name for c in left), h.name)
    else:
        ctx.changed(f"removed {what}", h.name)


def _ray_head(dep: Deployment, containers: list[labels.Container]) -> str | None:
    """The running Ray head container among the head's (the first container of an engine whose
    launch waits for Ray to list every node), or None."""
    running = {c.name for c in containers if c.running}
    for eng in dep.profile.engines:
        try:
            stages = launch(dep.profile, eng, {}).stages
        except EngineError:
            continue
        ray_head = stages[0].containers[0].name
        if any(s.wait == "ray-nodes" for s in stages) and ray_head in running:
            return ray_head
    return None


def _ray_status(dep: Deployment, head: Host, containers: list[labels.Container]) -> str | None:
    rh = _ray_head(dep, containers)
    if not rh:
        return None
    r = head.run(docker(head, "exec", rh, "python3", "-c", RAY_PROBE), change=False, timeout=60)
    seen = ray_nodes(r.stdout, head.name)
    if not seen:
        return "Ray: no answer"
    return "Ray: " + ", ".join(f"{s.ip} ({s.gpus:g} GPU)" for s in seen)


RESTARTS_SHOWN = 5


def _restarts(ctx: StepContext, head: Host) -> None:
    """The watchdog's restart records on the head (the last few, per engine)."""
    for eng in ctx.dep.profile.engines:
        recs = read_restarts(head, eng.name)
        for r in recs[-RESTARTS_SHOWN:]:
            ctx.ok(f"{eng.name}: {describe(r)}", head.name, restart=r)


def describe_container(c: labels.Container) -> str:
    """One container as ``serve.status`` shows it: name, state, since when, started by what."""
    since = f" since {c.started}" if c.started else ""
    by = f" by {c.started_by}" if c.started_by else ""
    return f"{c.name} {c.state}{since}{by}"


def _fabric(ctx: StepContext) -> None:
    """The last fabric test's verdict and figures (``link.fabric``'s record), when there is one."""
    rec = ctx.dep.records.read(FabricRecord)
    if rec is None:
        return
    when = f" ({rec.made.time_iso})" if rec.made else ""
    ctx.ok(f"link.fabric{when}: {rec.verdict}: {rec.why}", fabric=rec.model_dump(mode="json"))


def _metrics(ctx: StepContext, head: Host) -> None:
    """Prometheus' address, when its unit runs on the head (``metrics.up``)."""
    dep = ctx.dep
    if dep.profile.metrics.enabled and active(head, [metrics.PROMETHEUS_UNIT]):
        url = metrics.url(dep)
        ctx.ok(f"metrics: {url} (Prometheus on {head.name})", head.name, metrics=url)


def _gateway(ctx: StepContext, head: Host) -> None:
    """The gateway in front of the models ``serve.add`` placed, when it runs: what it routes."""
    if not unit_files(head, [gateway.UNIT]):
        return
    url = gateway.url(ctx.dep)
    listed = ep.models(url)
    if listed:
        ctx.ok(f"gateway: {url} routes {', '.join(listed)} (serve.list: where each serves)",
               head.name, gateway=url, models=listed)
    else:
        ctx.failed(f"gateway: {url} lists no model ({gateway.UNIT} on {head.name})", head.name)
    for d in gateway.on_demand(head):
        ctx.ok(d.line(), head.name, on_demand={"model": d.model, "unit": d.unit, "loaded": d.loaded,
                                               "events": list(d.events)})


@step(STEP_STATUS)
def status(ctx: StepContext) -> None:
    """What the nodes run of this deployment (by their containers' labels: engine, role, since
    when), Ray's nodes, and whether it serves what the profile says."""
    dep = ctx.dep

    def one(h: Host) -> list[labels.Container]:
        found = ours(h, dep.profile.name)
        ctx.ok(", ".join(map(describe_container, found)) or "no engine container", h.name,
               containers=[c.__dict__ for c in found])
        return found

    hosts = [dep.host(n.name) for n in dep.profile.nodes]
    found = dict(zip((h.name for h in hosts), ctx.each(hosts, one), strict=True))
    head = dep.profile.head.name
    ray = _ray_status(dep, dep.host(head), found.get(head) or [])
    if ray:
        ctx.ok(ray, head)
    _restarts(ctx, dep.host(head))
    _fabric(ctx)
    _metrics(ctx, dep.host(head))
    _gateway(ctx, dep.host(head))
    engines = {c.engine for cs in found.values() for c in cs or []}
    for eng in (e for e in dep.profile.engines if e.name in engines):
        got = serving(dep, eng)
        if got.url:
            ctx.ok(f"endpoint: {got.url} healthy ({eng.name} since {got.since or '?'}), serves "
                   f"{dep.profile.model.repo}", endpoint=got.url, engine=eng.name, since=got.since)
            rec = dep.records.read(ServeDecision)
            if rec and rec.chosen == eng.name and rec.startup:
                ctx.ok(f"{eng.name}: {startup_line(rec.startup)}", engine=eng.name,
                       startup=rec.startup)
        else:
            ctx.failed(got.why, engine=eng.name)
    unknown = sorted(engines - {e.name for e in dep.profile.engines})
    if unknown:
        ctx.failed(f"the nodes run engine(s) the profile does not name: {', '.join(unknown)} "
                   "(serve.down removes them)")
    if engines:
        return
    url = ep.url(dep)
    if not url:
        ctx.ok("nothing of this deployment serves (serve.up)")
    elif ep.health(url) and dep.profile.model.repo in ep.models(url):
        ctx.ok(f"endpoint: {url} healthy, serves {dep.profile.model.repo} (not run by "
               "sparkdeploy on these nodes)", endpoint=url)
    else:
        ctx.failed(f"endpoint: {url} not healthy", endpoint=url)


@step(STEP_LOGS)
def logs(ctx: StepContext, node: str | None = None, tail: int | None = None) -> None:
    """Each engine container's log on the nodes, as Log events."""
    def one(h: Host) -> None:
        found = ours(h, ctx.dep.profile.name)
        if not found:
            ctx.ok("no engine container", h.name)
        for c in found:
            lines = full_log(h, c.name)
            for line in lines[-tail:] if tail else lines:
                ctx.log(h.name, f"{c.name}: {line}")
            ctx.ok(f"{c.name} ({c.state}): {len(lines)} line(s)", h.name)

    ctx.each(ctx.dep.select(node), one)

