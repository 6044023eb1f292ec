"""Which files the weights are: decided once, from the hub's listing and the safetensors index
(``sparkdeploy.model.weights``, the rule), recorded on the head, read back by every step.

``model.download`` decides the selection from the hub's listing and index (fresh, else the
controller's cache) and records it on the head as it starts (``model_node.py mkroot --spec``:
``<model.path>/.sparkdeploy/selection.json``, the spec it fetches by, sizes and hashes
included). ``model.sync``, ``model.verify``, ``model.fit`` and the serve preflight read that
record (one helper run on the head, no hub): so any controller, a fresh clone too, covers
the same files the head holds. A record is used while it is for the profile's repo, revision
and ``allow_patterns``; a download re-decides only when the hub's commit moved. With no record
on the head (nothing downloaded yet, or the head unreachable) the selection is decided the
same way from the hub or the cache, and not recorded.

The selection rides in the metadata dict the steps pass around: ``files`` holds only the
selected files; ``selection`` says how they were chosen and what the repository lists.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.core.outside import HubName
from sparkdeploy.core.records import SHA1, HubFile
from sparkdeploy.model import weights
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import HostError
from sparkdeploy.node.nodeops import HelperFailed, run_helper
from sparkdeploy.ops.model import SCRIPT, ModelError, metadata


class SelectionInfo(BaseModel):
    """How the files were chosen (``weights.Selection``) and what the repository lists."""

    model_config = ConfigDict(extra="forbid")
    rule: Literal["index", "single"]
    weights: list[HubName] = Field(min_length=1)
    widened: list[HubName] = Field(default_factory=list)
    patterns: list[str] = Field(default_factory=list)
    listed_files: int = Field(ge=0)
    listed_bytes: int = Field(ge=0)


class Selected(BaseModel):
    """The selection as the head records it (the spec the download fetched by)."""

    model_config = ConfigDict(extra="ignore")
    repo: str
    revision: str
    commit: str = Field(pattern=SHA1)
    files: list[HubFile] = Field(min_length=1)
    selection: SelectionInfo


class _Recorded(BaseModel):
    """``model_node.py selection``'s answer."""

    selection: dict[str, Any] | None = None


def decide(dep: Deployment, meta: dict[str, Any]) -> dict[str, Any]:
    """The selected files of the hub's listing ``meta`` (``ModelError`` when the repository
    holds no weights the engine would load, or its index names a file it lacks)."""
    m = dep.profile.model
    listed = [f["path"] for f in meta["files"]]
    try:
        sel = weights.select(listed, meta.get("index"), m.allow_patterns, repo=m.repo)
    except weights.SelectionError as e:
        raise ModelError(str(e)) from None
    keep = set(sel.files)
    info = SelectionInfo(rule=sel.rule, weights=sel.weights, widened=sel.widened,
                         patterns=list(m.allow_patterns), listed_files=len(listed),
                         listed_bytes=sum(f["size"] for f in meta["files"]))
    return {"repo": meta["repo"], "revision": meta["revision"], "commit": meta["commit"],
            "files": [f for f in meta["files"] if f["path"] in keep],
            "selection": info.model_dump(), "fetched_at": meta.get("fetched_at", 0.0)}


def recorded(dep: Deployment) -> tuple[dict[str, Any] | None, str]:
    """(the selection the head records for the profile's repo, revision and patterns, or None;
    why there is none when the head could not be asked)."""
    m = dep.profile.model
    head = dep.host(dep.profile.head.name)
    try:
        out = run_helper(head, SCRIPT, ["selection", "--dir", m.path], result=_Recorded,
                         where=f"{head.name}: selection")
    except (HelperFailed, HostError) as e:
        return None, f"the head's selection not read: {str(e).splitlines()[0]}"
    if out.selection is None:
        return None, ""
    try:
        rec = Selected.model_validate(out.selection)
    except ValueError:
        return None, f"{head.name}: the recorded selection is not one; decided again"
    if (rec.repo, rec.revision, rec.selection.patterns) != (m.repo, m.revision,
                                                            list(m.allow_patterns)):
        return None, ""
    return {**rec.model_dump(), "fetched_at": 0.0}, ""


def selected(dep: Deployment, refresh: bool = False) -> tuple[dict[str, Any], str]:
    """(the selected files' metadata, note): the head's record; with ``refresh`` (the
    download), decided from the hub's listing first (a repository refused touches no node),
    and the head's record kept while it is for the same commit."""
    if refresh:
        meta, note = metadata(dep, refresh=True)
        fresh = decide(dep, meta)
        rec, why = recorded(dep)
        if rec is not None and rec["commit"] == meta["commit"]:
            return rec, note
        return fresh, "; ".join(n for n in (note, why) if n)
    rec, why = recorded(dep)
    if rec is not None:
        return rec, ""
    meta, note = metadata(dep, refresh=False)
    return decide(dep, meta), "; ".join(n for n in (note, why) if n)


def describe(meta: dict[str, Any]) -> str:
    """One line: what the selection fetches of what the repository holds."""
    info = meta["selection"]
    sel = weights.Selection(files=[f["path"] for f in meta["files"]], weights=info["weights"],
                            rule=info["rule"], widened=info["widened"])
    return weights.describe(sel, {f["path"]: f["size"] for f in meta["files"]},
                            info["listed_bytes"])


__all__ = ["Selected", "SelectionInfo", "decide", "describe", "recorded", "selected"]
