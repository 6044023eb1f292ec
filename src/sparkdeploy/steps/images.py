"""Choose an image: probe every candidate on the head, decide, and build the derivative image.

``probe`` runs ``helpers/probe_image.py`` inside each candidate (``docker run --rm --network
none``, the probe and the model's config mounted read only), checks its platform against the
head's architecture, and writes a decision record (JSON and Markdown) under the state dir; the
decision is the probe's last result. ``build`` builds the derivative image (the profile's
``images.layer``: a candidate plus a pinned transformers) with the head's Docker daemon, with
``transformers>=5`` resolved to one exact version first; it is ``ok`` without building when an
image of the same recipe (base image ID, Dockerfile hash, version) already exists."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from sparkdeploy.core import labels as lbl
from sparkdeploy.core import packaged
from sparkdeploy.core.errors import PartFailed, StepFailed
from sparkdeploy.core.files import MB, Escape, InputError, read_input, under
from sparkdeploy.core.fingerprint import Fingerprint, flat
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.records import ImageDecision, Written, markdown_table
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host, HostError, NodeUnreachable
from sparkdeploy.node.nodeops import (
    ARCH,
    HelperFailed,
    docker,
    inspect_image,
    node_arch,
    run_helper,
    stage,
    stage_script,
)
from sparkdeploy.ops.image import STEP_BUILD, chosen, decision, digest_of, image_id
from sparkdeploy.steps.registry import Ran, StepContext, step

STEP_PROBE = "image.probe"
PROBE = "probe_image.py"
LABEL_BASE_ID = lbl.BASE_ID
LABEL_TF = lbl.TRANSFORMERS
LABEL_DOCKERFILE = lbl.DOCKERFILE
LABEL_REQUIREMENT = lbl.REQUIREMENT
LABEL_ENGINE_REQUIRES = lbl.ENGINE_REQUIRES
DOCKER_DIR = "docker"
"""The Dockerfiles sparkdeploy ships (``sparkdeploy/data/docker/``): the only files
``images.layer.dockerfile`` may name."""


# -- the model's config ------------------------------------------------------------------------


class ConfigUnavailable(StepFailed):
    pass


def model_config_text(dep: Deployment, head: Host) -> tuple[str, str]:
    """The model's config.json: from the downloaded model on the head, else from the hub
    (``hf_hub_download`` of that one small file). Returns (text, where it came from)."""
    model = dep.profile.model
    path = f"{model.path.rstrip('/')}/config.json"
    r = head.run(["cat", path], change=False)
    if r.ok and r.stdout.strip():
        return r.stdout, f"{head.name}:{path}"
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(model.repo, "config.json", revision=model.revision,
                                cache_dir=str(dep.state.path / "hf-cache"), endpoint=model.endpoint)
    except Exception as e:  # noqa: BLE001 - any hub failure is reported as one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigUnavailable(f"config.json is neither on {head.name} ({path}) nor fetchable "
                                f"from the hub: {msg}") from None
    return Path(local).read_text(), f"hub:{model.repo}@{model.revision}"


# -- probe -------------------------------------------------------------------------------------


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class EngineProbe(_Loose):
    """What ``probe_image.py`` says of one engine in an image."""

    installed: bool = False
    version: str | None = None
    model_files: dict[str, bool] = {}
    requires: dict[str, str] = {}
    ok: bool = False
    reasons: list[str] = []


class ProbeReport(_Loose):
    """``probe_image.py``'s answer (what is read of it is checked, the rest kept)."""

    packages: dict[str, str | None] = {}
    config: dict[str, Any] | None = None
    engines: dict[str, EngineProbe] = {}
    nccl: dict[str, Any] | None = None


def probe_argv(dep: Deployment, head: Host, ref: str, probe_path: str, config_dir: str) -> list[str]:
    rules = dep.profile.images.rules
    args = [
        "run", "--rm", "--network", "none",
        *lbl.of_run(dep.profile.name, "probe", STEP_PROBE, dep.wall()),
        "-e", "HF_HUB_OFFLINE=1", "-e", "TRANSFORMERS_OFFLINE=1",
        "-v", f"{probe_path}:/sparkdeploy/probe_image.py:ro",
        "-v", f"{config_dir}:/sparkdeploy/model:ro",
        "--entrypoint", "python3", ref, "/sparkdeploy/probe_image.py",
        "--model-dir", "/sparkdeploy/model",
    ]  # fmt: skip
    for engine, rule in rules.items():
        for f in rule.model_files:
            args += ["--model-file", f"{engine}={f}"]
        args += ["--min-version", f"{engine}={rule.min_version}"]
        if rule.require_config:
            args += ["--require-config", engine]
    return docker(head, *args)


def _config_only(reasons: list[str]) -> bool:
    return bool(reasons) and all("transformers" in r for r in reasons)


def judge(dep: Deployment, ref: str, engine: str, arch: str, info: dict | None,
          report: dict | None, error: str | None) -> dict[str, Any]:
    """The verdict on one candidate: viable, needs-layer, rejected or missing, and why."""
    row: dict[str, Any] = {"image": ref, "engine": engine, "present": info is not None}
    if info is None:
        return {**row, "verdict": "missing", "why": error or "not on the head and not pullable"}
    img_arch = image_arch(info)
    row["digest"], row["image_id"] = digest_of(info, ref), info.get("Id")
    row["platform"] = f"{info.get('Os', 'linux')}/{img_arch}"
    row["platform_ok"] = img_arch == arch
    if report is None:
        return {**row, "verdict": "rejected", "why": f"probe failed: {error}"}
    row["probe"] = report
    eng = (report.get("engines") or {}).get(engine, {})
    row["engine_version"] = eng.get("version")
    row["transformers"] = (report.get("packages") or {}).get("transformers")
    row["config_ok"] = (report.get("config") or {}).get("ok")
    row["files_ok"] = all((eng.get("model_files") or {}).values()) if eng.get("model_files") else None
    row["nccl"] = report.get("nccl")
    reasons = list(eng.get("reasons") or [])
    if not row["platform_ok"]:
        reasons.insert(0, f"image is {row['platform']}, {dep.profile.head.name} is linux/{arch}")
    derivative = dep.profile.images.layer
    if not reasons and eng.get("ok"):
        return {**row, "verdict": "viable", "why": f"{engine} {eng.get('version')} with every "
                f"model file" + (", config parses" if row["config_ok"] else "")}
    if row["platform_ok"] and _config_only(reasons) and derivative and derivative.base == ref:
        return {**row, "verdict": "needs-layer", "why": "; ".join(reasons)
                + f"; fixed by the layer {derivative.requirement} -> {derivative.tag}"}
    return {**row, "verdict": "rejected", "why": "; ".join(reasons) or "probe says not ok"}


def nccl_line(nccl: dict[str, Any] | None) -> str:
    """What the probe says of NCCL, in words: the library torch loads, its version, and the
    other library's version when both are in the image (``""`` when the probe said nothing)."""
    if not nccl:
        return ""
    loads = nccl.get("loads")
    wheel, system = nccl.get("wheel") or {}, nccl.get("system") or {}
    if loads is None:
        return "none in the image"
    name = {"wheel": f"the {wheel.get('package') or 'nvidia-nccl'} wheel's",
            "system": "the system's libnccl2"}.get(loads, "")
    line = f"loads {name or nccl.get('path')} {nccl.get('version') or '(version unknown)'}".replace("  ", " ")
    other = system if loads == "wheel" else wheel if loads == "system" else {}
    if other:
        what = "libnccl2" if loads == "wheel" else (wheel.get("package") or "nvidia-nccl wheel")
        line += f" (also {what} {other.get('version') or '?'})"
    return line


def image_arch(info: dict) -> str:
    a = info.get("Architecture") or "?"
    return ARCH.get(a, a)


def probed_for(dep: Deployment) -> dict[str, Any]:
    """The model the candidates are judged for, and the decision the probe left (one gone or
    replaced since is no reason to reuse it)."""
    rec = decision(dep)
    return {"model.repo": dep.profile.model.repo, "model.revision": dep.profile.model.revision,
            "decided": rec.made.time if rec and rec.made else None}


def candidate_ids(dep: Deployment) -> dict[str, Any]:
    """The candidates by ID on the head (asks the head): a tag that moved is a new candidate."""
    return {f"id[{c.ref}]": image_id(dep, c.ref) for c in dep.profile.images.candidates}


@step(STEP_PROBE, needs=("hosts.check", "model.precheck"), reuse=True,
      fingerprint=Fingerprint("images", also=probed_for, asks=candidate_ids))
def probe(ctx: StepContext, only: str | None = None) -> None:
    """Probe every candidate (or only the image ``only``) on the head, decide, and write the
    decision record ``image-probe`` (not in a dry run): the decision is the last result."""
    dep = ctx.dep
    head = dep.host(dep.profile.head.name)
    candidates = [c for c in dep.profile.images.candidates if only is None or c.ref == only]
    if not candidates:
        ctx.failed(f"{only} is not a candidate of the profile", head.name)
        return
    try:
        arch = head.node.arch
        real = node_arch(head)
        if real != arch:
            ctx.failed(f"{head.name} is linux/{real}, the profile says arch: {arch} "
                       f"(fix nodes[].arch in {dep.profile_path})", head.name)
            return
        text, source = model_config_text(dep, head)
        config_path = stage(head, "model/config.json", text)
        probe_path = stage_script(head, PROBE)
    except NodeUnreachable:
        raise  # not a HostError of the step's own: one failed result for the node (the context)
    except (HostError, ConfigUnavailable) as e:
        raise PartFailed(str(e), head.name) from None
    rows: list[dict[str, Any]] = []
    for i, cand in enumerate(candidates):
        ctx.progress(head.name, i, len(candidates), "images", cand.ref)
        row = _probe_one(dep, head, cand.ref, cand.engine, arch, probe_path, config_path)
        rows.append(row)
        status = Status.OK if row["verdict"] in ("viable", "needs-layer") else Status.SKIPPED
        nccl = nccl_line(row.get("nccl"))
        ctx.report(Result(STEP_PROBE, status, f"{cand.ref}: {row['verdict']}: {row['why']}"
                          + (f"; NCCL: {nccl}" if nccl else ""),
                          head.name, {k: v for k, v in row.items() if k not in ("probe", "why")}))
    record = decide(dep, head.name, arch, source, rows)
    if dep.dry:
        ctx.would("write the decision record: " + record["summary"], head.name)
        return
    written = write_record(dep, record)
    (ctx.changed if record["chosen"] else ctx.failed)(
        f"{record['summary']} (record: {written.markdown})", head.name, chosen=record["chosen"])


def _probe_one(dep: Deployment, head: Host, ref: str, engine: str, arch: str, probe_path: str,
               config_path: str) -> dict[str, Any]:
    """Pull the candidate when the head lacks it, run the probe in it (the staged probe and
    config checked against their sha256 first), judge it."""
    config_dir = config_path.rsplit("/", 1)[0]
    info = inspect_image(head, ref)
    err = None
    if info is None:
        pull = head.run(docker(head, "pull", ref), timeout=1800)
        if pull.dry:
            err = "not on the head; would pull it"
        elif pull.ok:
            info = inspect_image(head, ref)
        else:
            err = f"not on the head, pull failed: {pull.one_line_error()}"
    report = None
    if info is not None:
        try:
            report = run_helper(head, PROBE, [], result=ProbeReport, script=probe_path,
                                also=[config_path], where=f"{head.name}: {PROBE} in {ref}",
                                wrap=lambda p: probe_argv(dep, head, ref, p, config_dir)).model_dump()
        except HelperFailed as e:
            err = str(e)
    return judge(dep, ref, engine, arch, info, report, err)


def decide(dep: Deployment, node: str, arch: str, source: str, rows: list[dict]) -> dict[str, Any]:
    """The decision: per serving engine the first usable candidate, and the one chosen."""
    per_engine: dict[str, Any] = {}
    for eng in dep.profile.engines:
        for row in rows:
            if row["engine"] == eng.software and row["verdict"] in ("viable", "needs-layer"):
                per_engine[eng.name] = {"image": row["image"], "kind": eng.kind,
                                        "digest": row.get("digest"),
                                        "needs_layer": row["verdict"] == "needs-layer",
                                        "serve_image": (dep.profile.images.layer.tag
                                                        if row["verdict"] == "needs-layer"
                                                        and dep.profile.images.layer else row["image"])}
                break
    chosen = next(({"engine": name, **v} for name, v in per_engine.items()), None)
    if chosen:
        summary = (f"chosen {chosen['image']} for {chosen['engine']}"
                   + (" + the transformers layer" if chosen["needs_layer"] else ""))
    else:
        summary = "no viable candidate"
    return {"node": node, "arch": arch, "config_from": source, "chosen": chosen,
            "engines": per_engine, "candidates": rows, "summary": summary}


PROBE_COLUMNS = ["image", "engine", "engine version", "transformers", "model files",
                 "config parses", "platform", "verdict", "digest", "NCCL"]


def probe_rows(record: dict[str, Any]) -> list[list[str]]:
    """One row per candidate under ``PROBE_COLUMNS`` (the record's Markdown and the task's
    table)."""
    def yn(v: Any) -> str:
        return "-" if v is None else ("yes" if v else "no")

    return [[r["image"], r["engine"], r.get("engine_version") or "-", r.get("transformers") or "-",
             yn(r.get("files_ok")), yn(r.get("config_ok")),
             r.get("platform", "-") + ("" if r.get("platform_ok", True) else " (!)"), r["verdict"],
             r.get("digest") or "-", nccl_line(r.get("nccl")) or "-"]
            for r in record["candidates"]]


def probe_markdown(record: dict[str, Any]) -> str:
    lines = [f"Probed on {record['node']} ({record['arch']}); model config from "
             f"{record['config_from']}.", "", f"**{record['summary']}**", "",
             markdown_table(PROBE_COLUMNS, probe_rows(record)), "", "## Why", ""]
    for r in record["candidates"]:
        lines.append(f"- `{r['image']}` ({r['engine']}): {r['verdict']}: {r['why']}")
    lines += ["", "## Per engine", ""]
    for name, v in record["engines"].items():
        lines.append(f"- {name}: serve `{v['serve_image']}`"
                     + (f" (built from `{v['image']}` + the transformers layer)" if v["needs_layer"]
                        else ""))
    return "\n".join(lines)


def write_record(dep: Deployment, record: dict[str, Any]) -> Written:
    """The decision as ``ImageDecision`` (``<state_dir>/decisions/<profile>/image-probe.{json,md}``)."""
    return dep.records.write(ImageDecision.model_validate(record), markdown=probe_markdown(record),
                             title=f"Image decision for {dep.profile.name}")


# -- build -------------------------------------------------------------------------------------


class ResolveError(StepFailed):
    pass


def resolve_requirement(requirement: str, index_url: str, get: Callable | None = None,
                        constraint: str = "") -> str:
    """The newest final release on the index that satisfies ``requirement`` and the extra
    specifier ``constraint`` (what the base image's engine declares) (PEP 503 page)."""
    from packaging.requirements import Requirement
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
    from packaging.version import InvalidVersion

    req = Requirement(requirement)
    try:
        spec = req.specifier & SpecifierSet(constraint)
    except InvalidSpecifier:
        raise ResolveError(f"cannot read the version specifier {constraint!r}") from None
    url = f"{index_url.rstrip('/')}/{canonicalize_name(req.name)}/"
    if get is None:
        import requests

        def get(u: str) -> str:
            resp = requests.get(u, timeout=30)
            resp.raise_for_status()
            return resp.text

    try:
        page = get(url)
    except Exception as e:  # noqa: BLE001 - reported as one line
        raise ResolveError(f"cannot read {url}: {e}") from None
    versions = set()
    for name in re.findall(r">([^<>]+\.(?:whl|tar\.gz|zip))</a>", page):
        try:
            if name.endswith(".whl"):
                versions.add(parse_wheel_filename(name)[1])
            else:
                versions.add(parse_sdist_filename(name)[1])
        except (InvalidVersion, ValueError):
            continue
    good = sorted(v for v in versions if not v.is_prerelease and spec.contains(v))
    if not good:
        raise ResolveError(f"no release of {req.name} on {index_url} satisfies {requirement}"
                           + (f" and {req.name}{constraint}" if constraint else ""))
    return str(good[-1])


def engine_requires(dep: Deployment, head: Host, ref: str) -> tuple[str, str, str] | None:
    """(engine, its version, its declared transformers specifier) in the image ``ref``, read
    from the engine's own metadata by the probe (staged, checked, run offline in the image);
    None when the profile names no engine for ``ref`` or the engine declares nothing."""
    kind = next((c.engine for c in dep.profile.images.candidates if c.ref == ref), None)
    if kind is None:
        return None
    def argv(path: str) -> list[str]:
        return docker(head, "run", "--rm", "--network", "none",
                      *lbl.of_run(dep.profile.name, "probe", STEP_BUILD, dep.wall()),
                      "-v", f"{path}:/sparkdeploy/probe_image.py:ro", "--entrypoint", "python3",
                      ref, "/sparkdeploy/probe_image.py", "--engine", kind)

    try:
        report = run_helper(head, PROBE, [], result=ProbeReport, wrap=argv,
                            where=f"{head.name}: {PROBE} in {ref}")
        eng = report.engines[kind]
    except (HelperFailed, KeyError) as e:
        why = e if isinstance(e, HelperFailed) else f"it names no engine {kind}"
        raise ResolveError(f"cannot read what {kind} in {ref} requires: {why}") from None
    spec = eng.requires.get("transformers")
    if not eng.installed or spec is None:
        return None
    return kind, str(eng.version), spec


def legacy_dockerfile(text: str) -> str:
    """The Dockerfile for the legacy builder (the docker API): every ``--mount=...`` removed."""
    return re.sub(r"--mount=\S+\s*", "", text)


def build_context(dockerfile: str, config_text: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("Dockerfile", legacy_dockerfile(dockerfile).encode()),
                           ("probe_image.py", packaged.helper("probe_image.py").read_bytes()),
                           ("model/config.json", config_text.encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _find_built(head: Host, labels: dict[str, str]) -> str | None:
    args = ["image", "ls", "-q", "--no-trunc"]
    for k, v in labels.items():
        args += ["--filter", f"label={k}={v}"]
    r = head.run(docker(head, *args), change=False)
    ids = [x for x in r.stdout.split() if x] if r.ok else []
    return ids[0] if ids else None


def layer_and_base(dep: Deployment) -> dict[str, Any]:
    """The profile's derivative image and the image the probe chose to build it on."""
    return {**flat({"layer": dep.profile.model_dump(mode="json")["images"].get("layer")}),
            **flat({"chosen": chosen(dep)})}


def why_skip_build(dep: Deployment, runs: Mapping[str, Ran], forced: bool) -> str | None:
    """Why a plan's ``image.build`` has nothing to build (None: build): no derivative image in
    the profile, or the chosen image serves as it is."""
    c = chosen(dep)
    if dep.profile.images.layer is None:
        return "the profile has no images.layer"
    if c and not c.get("needs_layer"):
        return f"the chosen image {c.get('image')} needs no layer"
    return None


@step(STEP_BUILD, needs=(STEP_PROBE,), long=True, fingerprint=Fingerprint(also=layer_and_base),
      when=why_skip_build)
def build(ctx: StepContext, no_cache: bool = False) -> None:
    """Build the derivative image on the head (ok without building when already built;
    ``no_cache``: build again from the base, docker's layer cache unused)."""
    _build(ctx, no_cache)


STEP_LINE = re.compile(r"^Step (\d+)/(\d+) : ")


def _build(ctx: StepContext, no_cache: bool = False) -> Result:
    dep = ctx.dep
    derivative = dep.profile.images.layer
    head = dep.host(dep.profile.head.name)
    if derivative is None:
        return ctx.skipped("the profile has no images.layer", head.name)
    try:
        path = under(packaged.data(DOCKER_DIR), derivative.dockerfile.removeprefix(DOCKER_DIR + "/"))
        dockerfile = read_input(path, limit=MB, what="Dockerfile").decode("utf-8")
    except (Escape, InputError) as e:
        raise PartFailed(f"images.layer.dockerfile: {e}", head.name) from None
    except UnicodeDecodeError:
        raise PartFailed(f"{derivative.dockerfile}: not UTF-8 text", head.name) from None
    base = inspect_image(head, derivative.base)
    if base is None:
        return ctx.failed(f"base image {derivative.base} is not on {head.name} "
                      "(run image.probe, which pulls missing candidates)", head.name)
    try:
        declared = engine_requires(dep, head, derivative.base)
        engine_note = "none declared"
        constraint = ""
        if declared:
            kind, kind_version, spec = declared
            engine_note = f"{kind} {kind_version}: transformers{spec}"
            if derivative.override_engine_requirement:
                engine_note += " (overridden by images.layer.override_engine_requirement)"
            else:
                constraint = spec
        try:
            version = resolve_requirement(derivative.requirement, derivative.index_url,
                                          constraint=constraint)
        except ResolveError as e:
            if not constraint:
                raise
            raise ResolveError(f"{e}, which {engine_note.split(':')[0]} in {derivative.base} "
                               "declares (images.layer.override_engine_requirement: true "
                               "builds anyway)"
                               ) from None
    except ResolveError as e:
        raise PartFailed(str(e), head.name) from None
    df_sha = hashlib.sha256(dockerfile.encode()).hexdigest()
    labels = {LABEL_BASE_ID: base["Id"], LABEL_DOCKERFILE: df_sha, LABEL_TF: version,
              lbl.NCCL: derivative.nccl}
    existing = None if no_cache else _find_built(head, labels)
    what = (f"{derivative.tag} = {derivative.base} + transformers=={version} ({engine_note})"
            + (" + the system NCCL" if derivative.nccl == "system" else ""))
    if existing:
        tagged = inspect_image(head, derivative.tag)
        if tagged and tagged["Id"] == existing:
            return ctx.ok(f"{what} already built ({existing[:19]})", head.name,
                      image_id=existing, transformers=version)
        head.run(docker(head, "tag", existing, derivative.tag))
        return ctx.changed(f"tagged the existing build {existing[:19]} as {derivative.tag}",
                       head.name, image_id=existing, transformers=version)
    if dep.dry:
        return ctx.skipped(f"would build {what}" + (" without docker's cache" if no_cache
                                                           else ""), head.name, transformers=version)
    try:
        config_text, _ = model_config_text(dep, head)
    except ConfigUnavailable as e:
        raise PartFailed(str(e), head.name) from None
    build_args = {"BASE_IMAGE": derivative.base, "BASE_IMAGE_ID": base["Id"],
                  "BASE_IMAGE_DIGEST": digest_of(base, derivative.base), "NCCL": derivative.nccl,
                  "TRANSFORMERS_VERSION": version, "DOCKERFILE_SHA256": df_sha,
                  "TRANSFORMERS_REQUIREMENT": derivative.requirement, "ENGINE_REQUIRES": engine_note,
                  "PIP_INDEX_URL": derivative.index_url}
    if urlsplit(derivative.index_url).scheme == "http":
        build_args["PIP_TRUSTED_HOST"] = urlsplit(derivative.index_url).hostname or ""
    context = base64.b64encode(build_context(dockerfile, config_text)).decode()
    started = dep.clock()
    log = BuildLog(ctx, head.name)
    r = head.run(build_argv(head, derivative.tag, build_args, no_cache), input=context,
                 on_stderr=log.line, timeout=3600)
    if not r.ok:
        return ctx.failed(f"build failed: {r.one_line_error()}", head.name,
                      log_tail=log.tail)
    built = inspect_image(head, derivative.tag)
    if not built:
        return ctx.failed(f"build finished but {derivative.tag} is not on {head.name}", head.name)
    return ctx.changed(f"built {what} in {dep.clock() - started:.0f}s "
                   f"({built['Id'][:19]})", head.name, image_id=built["Id"], transformers=version)


def build_argv(head: Host, tag: str, build_args: dict[str, str], no_cache: bool) -> list[str]:
    """``docker build`` on the head of the context that comes on stdin (a tar, base64: stdin
    is text), with docker's classic builder (its ``Step N/M`` log), the log on stderr as it
    comes. Every value is one ``--flag=value`` word: none can be read as an option."""
    argv = docker(head, "build", f"--tag={tag}",
                  *(f"--build-arg={k}={v}" for k, v in build_args.items()),
                  "--network=host", "--rm", "--force-rm", *(["--no-cache"] if no_cache else []),
                  "-")
    return ["sh", "-c", 'base64 -d | DOCKER_BUILDKIT=0 "$@" 1>&2', "sh", *argv]


class BuildLog:
    """The build's output handed to the event stream as it comes (``Log`` per line,
    ``Progress`` per ``Step N/M``); the last 20 lines kept."""

    def __init__(self, ctx: StepContext, node: str):
        self.ctx, self.node = ctx, node
        self.tail: list[str] = []

    def line(self, line: str) -> None:
        if not line.strip():
            return
        self.tail = (self.tail + [line])[-20:]
        self.ctx.log(self.node, line)
        m = STEP_LINE.match(line)
        if m:
            self.ctx.progress(self.node, int(m[1]) - 1, int(m[2]), "steps", line[m.end():][:60])
