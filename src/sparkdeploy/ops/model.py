"""The weights: a verified download on the head, a pipelined fan-out to the workers.

``model.download``: the profile's repo, revision and patterns into ``model.path`` on a node,
by ``huggingface_hub`` running on the node in an isolated environment of sparkdeploy's choosing
(a container of an image the node already has, or a virtualenv of its own: never the node's
system Python). The token (``HF_TOKEN`` or the hub login on the controller) reaches the
downloader through its stdin only. The node-side helper (``helpers/model_node.py``) hashes each
file as it completes and appends it to a record in ``<path>/.sparkdeploy/verified.jsonl``:
that record is how ``model.sync`` knows a file is complete and verified on the head while the
download still runs, and why a second verify of unchanged files reads nothing.

``model.sync``: see ``sparkdeploy.ops.model_sync``; ``model.verify``: see
``sparkdeploy.steps.model_verify``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import quote, urljoin, urlsplit

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.core import labels, threads
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.outside import HubName, OutsideError, name_problem, request
from sparkdeploy.core.records import SHA1, SHA256, HubMetadata, RecordError
from sparkdeploy.model import weights
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Feed, Host
from sparkdeploy.node.nodeops import (
    HelperFailed,
    docker,
    free_space,
    inspect_image,
    run_helper,
    stage,
    stage_script,
    staged_files,
)
from sparkdeploy.ops import Ctx

DOWNLOAD = "model.download"
VERIFY = "model.verify"
SCRIPT = "model_node.py"
CONTAINER = "sparkdeploy-model-download"
GB = 1e9
HUB_DEADLINE_S = 20.0
"""The whole of the hub's metadata call (a large repo's file list comes in well under it)."""


class ModelError(StepFailed):
    """A model step cannot go on; ``str()`` is the one line to show."""


# --- the hub's metadata, cached on the controller ------------------------------------------

def cache_name(dep: Deployment) -> str:
    """The ``HubMetadata`` record's name: ``<repo>@<revision>``, ``/`` spelled ``--``."""
    m = dep.profile.model
    return f"{m.repo.replace('/', '--')}@{m.revision.replace('/', '--')}"


def controller_token() -> str | None:
    """The token the controller would use: ``HF_TOKEN`` or the hub login (never printed)."""
    from huggingface_hub import get_token

    return get_token()


def endpoint(dep: Deployment) -> str:
    if dep.profile.model.endpoint:
        return dep.profile.model.endpoint.rstrip("/")
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def hub_token(dep: Deployment) -> tuple[str | None, str]:
    """(the token for the profile's hub, why it is withheld): the token goes to an ``https``
    hub, or to an ``http`` one only when the profile trusts it (``model.trust_http``)."""
    token = controller_token()
    if not token:
        return None, ""
    if urlsplit(endpoint(dep)).scheme == "https" or dep.profile.model.trust_http:
        return token, ""
    return None, (f"the token is not sent to {endpoint(dep)} (plain http; model.trust_http: "
                  "true trusts it)")


class _Lfs(BaseModel):
    sha256: str = Field(pattern=SHA256)


class _Sibling(BaseModel):
    rfilename: HubName
    size: int | None = Field(default=None, ge=0)
    blobId: str | None = Field(default=None, pattern=SHA1)  # noqa: N815 - the hub's name
    lfs: _Lfs | None = None


class _ModelInfo(BaseModel):
    """What sparkdeploy reads of the hub's model info (the rest is ignored)."""

    sha: str = Field(pattern=SHA1)
    siblings: list[_Sibling] = Field(max_length=100_000)


def _hub_headers(dep: Deployment) -> dict[str, str]:
    token, _ = hub_token(dep)
    headers = {"Accept": "application/json", "User-Agent": "sparkdeploy"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def fetch_file(dep: Deployment, commit: str, name: str) -> bytes:
    """The repo's file ``name`` at ``commit``, read from the hub (a redirect is followed, to
    another host without the token); ``OutsideError`` when the hub does not answer."""
    m = dep.profile.model
    url = f"{endpoint(dep)}/{m.repo}/resolve/{commit}/{name}"
    headers = _hub_headers(dep)
    for _ in range(4):
        r = request("GET", url, headers=headers, deadline=HUB_DEADLINE_S)
        if r.status not in (301, 302, 303, 307, 308) or "location" not in r.headers:
            break
        nxt = urljoin(url, r.headers["location"])
        if urlsplit(nxt).netloc != urlsplit(url).netloc:
            headers.pop("Authorization", None)
        url = nxt
    if r.status != 200:
        raise OutsideError(f"{url}: HTTP {r.status}")
    return r.body


def fetch_index(dep: Deployment, commit: str) -> list[str]:
    """The files the repo's ``model.safetensors.index.json`` names (at ``commit``), read from
    the hub (``fetch_file``); ``ModelError`` when the answer is no index."""
    m = dep.profile.model
    body = fetch_file(dep, commit, weights.INDEX)
    try:
        names = weights.index_files(body, f"{m.repo}: {weights.INDEX}")
    except weights.SelectionError as e:
        raise ModelError(str(e)) from None
    for name in names:  # data: a name a node would act on is checked as the listing's are
        why = name_problem(name)
        if why:
            raise ModelError(f"the hub's answer is refused: {m.repo}: {weights.INDEX} names "
                             f"{name!r:.120}: {why}")
    return names


def fetch_metadata(dep: Deployment, cached: dict[str, Any] | None = None) -> dict[str, Any]:
    """The repo's files at the profile's revision from the hub, every one checked
    (``HubName``), and the files its safetensors index names (``cached``'s when it is for the
    same commit: a commit's files never change, so a re-run fetches no file); ``OutsideError``
    when the hub does not answer in time, ``ModelError`` when its answer is refused."""
    m = dep.profile.model
    url = (f"{endpoint(dep)}/api/models/{m.repo}/revision/{quote(m.revision, safe='')}"
           "?blobs=true")
    r = request("GET", url, headers=_hub_headers(dep), deadline=HUB_DEADLINE_S)
    if r.status != 200:
        raise OutsideError(f"{url}: HTTP {r.status}")
    try:
        info = r.json(_ModelInfo, url)
    except OutsideError as e:
        raise ModelError(f"the hub's answer is refused: {e}") from None
    files = [{"path": s.rfilename, "size": int(s.size or 0),
              "sha256": s.lfs.sha256 if s.lfs else None, "oid": s.blobId}
             for s in sorted(info.siblings, key=lambda s: s.rfilename)]
    listed = {f["path"] for f in files}
    if weights.INDEX not in listed:
        index = None
    elif cached and cached.get("commit") == info.sha and cached.get("index") is not None:
        index = cached["index"]
    else:
        index = fetch_index(dep, info.sha)
    return {"repo": m.repo, "revision": m.revision, "commit": info.sha, "files": files,
            "index": index, "fetched_at": time.time()}


def _usable_cache(rec: HubMetadata | None) -> dict[str, Any] | None:
    """A cached listing the selection can be decided from (one cached before the index was
    kept lists an index it does not hold: not used)."""
    if rec is None or (rec.index is None and any(f.path == weights.INDEX for f in rec.files)):
        return None
    return rec.model_dump()


def metadata(dep: Deployment, refresh: bool = True) -> tuple[dict[str, Any], str]:
    """(the hub's listing and index, note): fresh from the hub when it answers (and cached),
    else the cache. Which of the files to fetch: ``sparkdeploy.ops.model_select``."""
    try:
        cached, bad_cache = _usable_cache(dep.records.read(HubMetadata, cache_name(dep))), ""
    except RecordError as e:  # never used: a tampered one could name files outside the model dir
        cached, bad_cache = None, str(e)
    if cached and not refresh:
        return cached, ""
    try:
        meta = fetch_metadata(dep, cached)
    except OutsideError as e:  # a hub that cannot be reached falls back to the cache
        why = str(e)
        if cached:
            when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(cached.get("fetched_at", 0)))
            return cached, f"hub not reachable ({why}); using its metadata cached {when} UTC"
        cache = f"; the cache is not usable: {bad_cache}" if bad_cache else ""
        raise ModelError(f"cannot read {dep.profile.model.repo}@{dep.profile.model.revision} "
                         f"from {endpoint(dep)}: {why}{cache}") from None
    if not dep.dry:
        dep.records.write(HubMetadata.model_validate(meta), cache_name(dep))
    return meta, ""


def total_bytes(meta: dict[str, Any], only: list[str] | None = None) -> int:
    keep = set(only) if only is not None else None
    return sum(f["size"] for f in meta["files"] if keep is None or f["path"] in keep)


# --- on a node -------------------------------------------------------------------------------

@dataclass
class Staged:
    """The model helper and the spec it reads, staged on a node (``run_helper`` runs the helper
    only while both match their sha256)."""

    script: str
    spec: str


def stage_for(host: Host, meta: dict[str, Any]) -> Staged:
    """The helper and the spec on the node, staged side by side (one round trip, not two)."""
    spec = {k: meta[k] for k in ("repo", "revision", "commit", "files", "selection") if k in meta}
    with threads.pool(2) as p:
        script = p.submit(stage_script, host, SCRIPT)
        spec_path = p.submit(stage, host, "spec.json", json.dumps(spec, sort_keys=True))
    return Staged(script.result(), spec_path.result())


Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Answer(BaseModel):
    """A node helper's answer: what sparkdeploy reads of it is checked, the rest kept."""

    model_config = ConfigDict(extra="allow")


class NodeState(_Answer):
    """``model_node.py verify`` (and the ``state`` line of ``receive``)."""

    ok: list[str]
    missing: list[str]
    differ: dict[str, str]
    unchecked: list[str]
    hashed_bytes: Count = 0
    reused: Count = 0
    present: bool = False
    seconds: Seconds = 0.0
    download_running: bool = False


class ReceiverState(NodeState):
    free: Count
    mount: str


class VenvAnswer(_Answer):
    python: str = Field(min_length=1)
    created: bool = False


class RootAnswer(_Answer):
    """``model_node.py mkroot``: the model dir is there (made when it was missing)."""

    dir: str


class FetchAnswer(_Answer):
    fetched_bytes: Count = 0
    files: Count = 0
    present: Count = 0
    failed: dict[str, str] = {}
    seconds: Seconds = 0.0


class FileReport(BaseModel):
    """One ``file`` line of ``receive``."""

    path: str
    state: Literal["ok", "differ", "missing"]
    why: str


class ReadyReport(_Answer):
    port: int | None = Field(default=None, ge=1, le=65535)
    """None when no daemon listens (the ssh transport sends through the helper's own rsync)."""


def helper_json(host: Host, st: Staged, args: list[str], what: str, cls: type[Any],
                **run: Any) -> dict[str, Any]:
    """The staged model helper's answer to ``args``, checked as ``cls`` (a dict, as the steps
    read it); ModelError naming ``what`` otherwise."""
    try:
        return run_helper(host, SCRIPT, args, result=cls, where=f"{host.name}: {what}",
                          script=st.script, also=[st.spec], **run).model_dump()
    except HelperFailed as e:
        raise ModelError(str(e)) from None


def verify_args(dep: Deployment, st: Staged, only: list[str] | None = None,
                quick: bool = False) -> list[str]:
    args = ["verify", "--dir", dep.profile.model.path, "--spec", st.spec]
    if quick:
        args.append("--quick")
    if only:  # after "--": a file name is never read as an option
        args += ["--", *only]
    return args


def node_state(ctx: Ctx, host: Host, st: Staged, only: list[str] | None = None,
               quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """What the node holds, per the helper's verify (``quick``: records only, reads nothing);
    its hashing is progress of the step ``ctx`` reports for."""
    dep = ctx.dep
    quick = quick or dep.dry  # a dry run neither hashes nor writes records

    def on_progress(p: dict[str, str]) -> None:
        ctx.progress(host.name, int(p.get("bytes", 0)), int(p.get("total", 0)) or None, "B",
                     "hashing")

    return helper_json(host, st, verify_args(dep, st, only, quick), "verify helper failed",
                       NodeState, on_progress=on_progress if progress else None,
                       timeout=6 * 3600)


def describe_bad(state: dict[str, Any], limit: int = 3) -> str:
    bad = [(p, "missing") for p in state["missing"]] + list(state["differ"].items())
    shown = ", ".join(f"{p} ({why})" for p, why in bad[:limit])
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} files differ: {shown}{more}"


@dataclass(frozen=True)
class Short:
    """A node without room for the bytes it lacks: both numbers, for the step to report."""

    node: str
    why: str
    free: int
    need: int
    """What it lacks, with the profile's margin."""

    @property
    def details(self) -> dict[str, int]:
        return {"free": self.free, "need": self.need}


def disk_check(dep: Deployment, host: Host, need: int) -> Short | None:
    """Why the node lacks room for ``need`` bytes (naming both numbers), None when it has it."""
    got = free_space(host, dep.profile.model.path)
    return None if got is None else short_of(dep, host, need, *got)


def short_of(dep: Deployment, host: Host, need: int, free: int, mount: str) -> Short | None:
    """``disk_check`` for a node whose free bytes on ``mount`` are known already."""
    margin = dep.profile.model.disk_margin_mb * 1_000_000
    if free < need + margin:
        return Short(host.name, f"{host.name}: {free / GB:.2f} GB free on {mount}, needs "
                     f"{(need + margin) / GB:.2f} GB ({need / GB:.2f} GB missing + "
                     f"{margin / GB:.2f} GB margin)", free, need + margin)
    return None


# --- the downloader's environment --------------------------------------------------------------

@dataclass
class Runtime:
    kind: str  # container | venv
    image: str | None = None
    python: str | None = None
    why: str = ""


def candidate_images(dep: Deployment) -> list[str]:
    refs = [e.image for e in dep.profile.engines] + [c.ref for c in dep.profile.images.candidates]
    if dep.profile.images.layer:
        refs.append(dep.profile.images.layer.tag)
    return list(dict.fromkeys(refs))


def image_gets_no_token(dep: Deployment) -> bool:
    """A token would go to a community image's python, which the profile did not allow."""
    return hub_token(dep)[0] is not None and not dep.profile.model.token_to_image


def choose_runtime(dep: Deployment, host: Host, st: Staged) -> Runtime:
    want = dep.profile.model.runtime
    tried = []
    if want == "auto" and image_gets_no_token(dep):
        want = "venv"  # the token stays out of third-party images: the virtualenv is ours
    if want in ("auto", "container"):
        for ref in candidate_images(dep):
            if inspect_image(host, ref) is None:
                continue
            r = host.run(docker(host, "run", "--rm", "--network", "none",
                                *labels.of_run(dep.profile.name, "probe", DOWNLOAD, dep.wall()),
                                "--entrypoint", "python3", "--", ref, "-c",
                                "import huggingface_hub as h; print(h.__version__)"),
                         change=False, timeout=300)
            if r.ok:
                return Runtime("container", image=ref,
                               why=f"{ref} (huggingface_hub {r.stdout.strip()})")
            tried.append(ref)
        if want == "container":
            raise ModelError(f"{host.name}: no image there carries huggingface_hub "
                             f"(images with none: {', '.join(tried) or 'none of the profile'})")
    m = dep.profile.model
    if dep.dry:
        return Runtime("venv", python=m.venv, why=f"a virtualenv at {m.venv} (would create it)")
    out = helper_json(host, st, ["venv", "--venv", m.venv, "--index-url", m.index_url],
                      "no environment for the downloader", VenvAnswer, change=True, timeout=1800)
    return Runtime("venv", python=out["python"],
                   why=f"the virtualenv {out['python'].rsplit('/bin/', 1)[0]}"
                   + (" (created)" if out.get("created") else ""))


def fetch_argv(dep: Deployment, host: Host, rt: Runtime, st: Staged, owner: str,
               only: list[str] | None = None) -> list[str]:
    """The downloader's argv (``run_helper`` runs it only while its staged files match)."""
    m = dep.profile.model
    helper = ["fetch", "--dir", m.path, "--spec", st.spec, "--workers", str(m.download_workers),
              "--endpoint", endpoint(dep)]
    if only:  # after "--": a file name is never read as an option
        helper += ["--", *only]
    if rt.kind == "venv":
        return [rt.python or "python3", st.script, *helper]
    # -i: the token arrives on stdin; never -e (docker keeps env in the container's config)
    mounts = ["-v", f"{m.path}:{m.path}"]
    for d in dict.fromkeys(os.path.dirname(p) for p in (*staged_files(st.script), st.spec)):
        mounts += ["-v", f"{d}:{d}:ro"]
    return docker(host, "run", "--rm", "-i", "--name", CONTAINER,
                         *labels.of_run(dep.profile.name, "download", DOWNLOAD, dep.wall()),
                         "--network", "host",
                         "--user", owner, "-e", "HF_HOME=/tmp/hf-home", "-e",
                         "HF_HUB_DISABLE_TELEMETRY=1", *mounts, "--entrypoint", "python3", "--",
                         rt.image or "", st.script, *helper)


def run_fetch(ctx: Ctx, host: Host, rt: Runtime, st: Staged, meta: dict[str, Any],
              only: list[str] | None) -> tuple[dict[str, Any] | None, str]:
    """Run the downloader on the node; (its report, the one line of why when it failed)."""
    dep = ctx.dep
    m = dep.profile.model
    try:
        # the model dir, and the selection recorded in it: the head's record of what to fetch
        run_helper(host, SCRIPT, ["mkroot", "--dir", m.path, "--spec", st.spec], result=RootAnswer,
                   script=st.script, also=[st.spec], where=f"{host.name}: mkroot", change=True)
    except HelperFailed as e:
        why = str(e).removeprefix(f"{host.name}: mkroot: ")
        return None, why if why.startswith("cannot create ") else f"cannot create {m.path}: {why}"
    own = host.run(["stat", "-c", "%u:%g", "--", m.path], change=False)
    owner = own.stdout.strip() if own.ok else "0:0"
    started = dep.clock()
    retries: list[str] = []

    def on_progress(p: dict[str, str]) -> None:
        done = int(p.get("bytes", 0))
        secs = max(dep.clock() - started, 1e-6)
        ctx.progress(host.name, done, int(p.get("total", 0)) or None, "B",
                     f"{p.get('files', '?')}/{p.get('of', '?')} files, {done / secs / 1e6:.0f} MB/s")

    def on_line(line: str) -> None:
        if line.startswith("retry "):
            retries.append(line)
            ctx.log(host.name, line)

    token, withheld = hub_token(dep)
    if token and rt.kind == "container" and not m.token_to_image:
        token, withheld = None, (f"the token is not handed to {rt.image} (model.token_to_image: "
                                 "true allows it)")
    if withheld:
        ctx.log(host.name, withheld)
    # stdin stays open while the download runs: its end (this controller or its connection
    # gone) ends the downloader on the node, in a container or not
    feed = Feed()
    feed.send((token or "") + "\n")
    try:
        out = run_helper(host, SCRIPT, [], result=FetchAnswer, script=st.script, also=[st.spec],
                         wrap=lambda _: fetch_argv(dep, host, rt, st, owner, only), change=True,
                         where=f"{host.name}: the downloader's report", on_progress=on_progress,
                         on_line=on_line, input=feed, timeout=24 * 3600,
                         answers_failing=True).model_dump()
    except HelperFailed as e:
        if "is already in use" in e.stderr and CONTAINER in e.stderr:
            return None, f"a download is already running (container {CONTAINER})"
        return None, str(e).removeprefix(f"{host.name}: the downloader's report: ")
    finally:
        feed.close()
    if out.get("failed"):
        name, why = next(iter(out["failed"].items()))
        more = f" and {len(out['failed']) - 1} more" if len(out["failed"]) > 1 else ""
        return out, (f"{len(out['failed'])} of {len(meta['files'])} files failed: {name}: {why}"
                     f"{more}; {out.get('files', 0)} verified files kept, a re-run resumes")
    return out, ""


# --- the download -----------------------------------------------------------------------------

def in_gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def download_on(ctx: Ctx, host: Host, meta: dict[str, Any], note: str = "",
                only: list[str] | None = None) -> Result:
    """Fetch what the node lacks (of ``only``), as the step ``ctx`` reports for (a repair by
    ``model.verify`` too)."""
    dep = ctx.dep
    m = dep.profile.model
    note = f" ({note})" if note else ""
    try:
        st = stage_for(host, meta)
        have = node_state(ctx, host, st, only=only, quick=True)
        todo = have["missing"] + list(have["differ"]) + have["unchecked"]
        total = total_bytes(meta, only)
        if not todo:
            return ctx.ok(f"{host.name}: all {len(have['ok'])} files present and verified "
                      f"({in_gb(total)}) in {m.path}{note}", host.name, bytes=0, total=total)
        missing = total_bytes(meta, have["missing"] + list(have["differ"]))
        bad = disk_check(dep, host, missing)
        if bad:
            return ctx.failed(bad.why, bad.node, **bad.details)
        rt = choose_runtime(dep, host, st)
        if dep.dry:
            return ctx.skipped(f"{host.name}: would download {len(todo)} files "
                           f"(up to {in_gb(missing)}) of {m.repo}@{meta['commit'][:12]} into {m.path} "
                           f"with {rt.why}{note}", host.name)
        ctx.log(host.name, f"downloader: {rt.why}")
        started = dep.clock()
        out, why = run_fetch(ctx, host, rt, st, meta, todo)
        secs = dep.clock() - started
    except ModelError as e:
        return ctx.failed(str(e), host.name)
    if why:
        return ctx.failed(f"{host.name}: {why}", host.name)
    assert out is not None
    got = out.get("fetched_bytes", 0)
    rate = got / out["seconds"] if out.get("seconds") else 0.0
    return ctx.changed(f"{host.name}: {m.repo}@{meta['commit'][:12]}: fetched {in_gb(got)} "
                   f"in {secs:.1f}s ({rate / 1e6:.0f} MB/s), {len(meta['files'])} files verified "
                   f"({len(have['ok'])} were already){note}", host.name, bytes=got, seconds=secs,
                   rate=rate, runtime=rt.kind)


@contextmanager
def own_lock(dep: Deployment, name: str) -> Iterator[None]:
    """model.download and model.sync run side by side (the sync is pipelined behind the
    download): each holds a lock of its own, so a second download (or sync) fails at once."""
    if dep.dry:
        yield
        return
    with dep.state.lock(name, name=f"{name}.lock"):
        yield
