"""The controller's records, typed: what the steps decided and what they remember between runs.

Each kind of record is one pydantic model below, stored in one envelope by one writer
(``Records.write``) under the state dir::

    decisions/<profile>/image-probe.{json,md}    ImageDecision    the image and why
    decisions/<profile>/serve.{json,md}          ServeDecision    the engine and why
    decisions/<profile>/endpoint.json            Endpoint         where it serves
    decisions/<profile>/fabric.json              FabricRecord     the last fabric test (link.fabric)
    decisions/<profile>/deploy-<time>.{json,md}  DeployRun        one deploy.all run
    runs/<plan>-<profile>.json                   PlanMemory       each plan step's last outcome
    model/<repo>@<revision>.json                 HubMetadata      the hub's file list and index, cached

The envelope says when, by which step and for which profile a record was made::

    {"name", "step", "profile", "time", "time_iso", "data": <the record>}

Writes are atomic (``files.write_text_atomic``: a reader sees the old record or the new one) and
redacted; a record with Markdown (decisions people read) is written as ``.md`` beside it.
Reading validates the file into its type: a file that is not the record it should be is a
``RecordError`` naming the file, one line. Every file name goes through ``Records.path``, which
keeps it under the state dir. The state dir is the controller's cache of what it did; the
nodes hold the deployment itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_serializer

from sparkdeploy.core.errors import RunError
from sparkdeploy.core.files import Escape, under, write_text_atomic
from sparkdeploy.core.outside import HubName
from sparkdeploy.core.redaction import redact
from sparkdeploy.core.state import StateDir

DECISIONS = "decisions"


class RecordError(RunError):
    """A record that cannot be read or named: ``str()`` is the one line to show."""


class Envelope(BaseModel):
    """Who made a record and when."""

    model_config = ConfigDict(extra="forbid")
    name: str
    step: str
    profile: str
    time: float
    time_iso: str
    data: dict[str, Any]


class Record(BaseModel):
    """One kind of record: where it lives (``FOLDER``, in a folder per profile when
    ``PER_PROFILE``; ``NAME`` unless the writer names it), what it is called in an error
    (``WHAT``) and the step that makes it (``STEP``)."""

    model_config = ConfigDict(extra="ignore")
    FOLDER: ClassVar[str] = DECISIONS
    PER_PROFILE: ClassVar[bool] = True
    NAME: ClassVar[str | None] = None
    WHAT: ClassVar[str] = "record"
    STEP: ClassVar[str] = ""
    _envelope: Envelope | None = PrivateAttr(default=None)

    @property
    def made(self) -> Envelope | None:
        """The envelope it was read with (None for a record not read from a file)."""
        return self._envelope

    @classmethod
    def from_bare(cls, raw: Any) -> Record | None:
        """The record from a file written before the envelope (None: no such older form)."""
        return None


# --- the decisions ----------------------------------------------------------------------------

class EngineImage(BaseModel):
    """The image a serving engine runs: the candidate, and the layer over it when it needs it."""

    image: str
    kind: str
    needs_layer: bool
    serve_image: str
    digest: str | None = None
    """The candidate's digest when decided (``Candidate.digest``)."""


class ChosenImage(EngineImage):
    engine: str


class Candidate(BaseModel):
    """One probed candidate image (the probe's findings are kept as they came)."""

    model_config = ConfigDict(extra="allow")
    image: str
    engine: str
    verdict: str
    why: str = ""
    digest: str | None = None
    """Its repo digest when it came from a registry, else its image ID (``ops.image.digest_of``):
    the image the tag named when it was decided."""
    image_id: str | None = None
    nccl: dict[str, Any] | None = None
    """Which libnccl.so.2 its torch loads and both libraries' versions (the probe's ``nccl``)."""


class ImageDecision(Record):
    NAME = "image-probe"
    WHAT = "image decision"
    STEP = "image.probe"
    node: str
    arch: str
    config_from: str
    chosen: ChosenImage | None
    engines: dict[str, EngineImage]
    candidates: list[Candidate]
    summary: str


class Attempt(BaseModel):
    """An engine serve.up gave up on: how it failed and where, the diagnosis (``class`` in the
    file) and its evidence lines, the saved logs, the containers removed and any left behind;
    for a hang, its timings. A field not set (a hang's timings for an engine that exited, the
    fallback's delay for the last engine) is not written."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")
    engine: str
    outcome: str
    phase: str | None = None
    why: str = ""
    diagnosis: str | None = Field(default=None, validation_alias=AliasChoices("class", "diagnosis"),
                                  serialization_alias="class")
    summary: str = ""
    evidence: list[list[Any]] = Field(default_factory=list)
    """[log label, line number, line]"""
    logs: str = ""
    removed: dict[str, list[str]] = Field(default_factory=dict)
    left: dict[str, list[str]] = Field(default_factory=dict)
    stall_s: float | None = None
    silent_s: float | None = None
    hang_start: float | None = None
    given_up_at: float | None = None
    fallback_after_s: float | None = None
    """From the hang's start to the next engine's start (set when there is a next engine)."""
    startup: dict[str, float] | None = None
    """The startup milestones it reached before it failed (``ops.serve.STARTUP``)."""


class ServeDecision(Record):
    NAME = "serve"
    WHAT = "engine decision"
    STEP = "serve.up"
    tried: list[Attempt] = Field(default_factory=list)
    """The engines that failed before the one chosen: outcome, diagnosis class, evidence."""
    chosen: str | None
    run_dir: str
    startup: dict[str, float] | None = None
    """The chosen engine's startup milestones, seconds from its start (``ops.serve.STARTUP``)."""

    @field_serializer("tried")
    def _tried(self, tried: list[Attempt]) -> list[dict[str, Any]]:
        return [a.model_dump(mode="json", by_alias=True, exclude_unset=True) for a in tried]


class Endpoint(Record):
    """Where the deployment serves (the one home of the endpoint)."""

    NAME = "endpoint"
    WHAT = "endpoint"
    STEP = "serve.up"
    url: str
    engine: str
    model: str
    api_key_env: str | None = None


class FabricSize(BaseModel):
    bytes: int
    algbw_gbs: float
    busbw_gbs: float


class FabricRecord(Record):
    """``link.fabric``'s last outcome: the verdict, the figures per size (nccl-tests' algbw and
    busbw, GB/s), what was expected, and what ran it (the engine, its image, the backend)."""

    NAME = "fabric"
    WHAT = "fabric test"
    STEP = "link.fabric"
    verdict: str
    expected_gbs: float | None
    sizes: list[FabricSize]
    why: str
    engine: str | None = None
    image: str | None = None
    backend: str | None = None
    nodes: list[str] = Field(default_factory=list)


class BenchFigures(Record):
    """``bench.run``'s last figures at its lowest load, as the metrics publish them (the
    exporter's ``sparkdeploy_bench_*``)."""

    NAME = "bench-figures"
    WHAT = "bench figures"
    STEP = "bench.run"
    output_tok_s: float | None = None
    ttft_ms_median: float | None = None
    itl_ms_median: float | None = None
    time: float | None = None


class MetricsRecord(Record):
    """``metrics.up``'s last outcome: Prometheus' address, the units it started per node and the
    ports they hold (``serve.down`` and ``metrics.down`` remove them)."""

    NAME = "metrics"
    WHAT = "metrics record"
    STEP = "metrics.up"
    url: str
    units: dict[str, list[str]]
    ports: dict[str, list[int]]
    targets: int


class StepTiming(BaseModel):
    state: str
    elapsed: float | None
    why: str


class RunImage(BaseModel):
    """The image a run served, by tag and ID, the base it was built from, and why."""

    tag: str | None
    id: str | None
    base: str | None
    base_id: str | None
    engine: str | None
    needs_layer: bool | None
    summary: str | None
    candidates: list[Candidate]


class Tried(BaseModel):
    """An engine that failed before the one serving: how, its diagnosis, the evidence lines."""

    model_config = ConfigDict(populate_by_name=True)
    engine: str | None
    outcome: str | None
    diagnosis: str | None = Field(alias="class")
    phase: str | None
    why: str | None
    fallback_after_s: float | None
    evidence: list[list[Any]]


class RunEngine(BaseModel):
    chosen: str | None
    tried: list[Tried]
    decided: str | None
    run_dir: str | None
    startup: dict[str, float] | None = None
    """The chosen engine's startup milestones (``ServeDecision.startup``)."""
    serve_up: list[str]
    """What serve.up said in the run."""


class DeployRun(Record):
    WHAT = "deployment record"
    STEP = "deploy.all"
    plan: list[str]
    serial: bool
    wall_s: float
    failed: bool
    changed: bool
    image: RunImage
    engine: RunEngine
    endpoint: str | None
    steps: dict[str, StepTiming]
    bench: dict[str, Any] | None
    fabric: dict[str, Any] | None = None
    """The last fabric test (``FabricRecord``): run in this deployment or reused from before."""


# --- what steps remember ----------------------------------------------------------------------

class StepMemory(BaseModel):
    state: str
    why: str
    elapsed: float | None
    fingerprint: dict[str, Any] | None
    time: float


class PlanMemory(Record):
    """Per plan step, how it last ended and the fingerprint it ended with."""

    FOLDER = "runs"
    PER_PROFILE = False
    WHAT = "plan state"
    steps: dict[str, StepMemory]

    @classmethod
    def from_bare(cls, raw: Any) -> Record | None:
        return cls.model_validate(raw)


SHA1 = r"^[0-9a-f]{40}$"
SHA256 = r"^[0-9a-f]{64}$"


class HubFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: HubName
    size: int = Field(ge=0)
    sha256: str | None = Field(pattern=SHA256)
    oid: str | None = Field(pattern=SHA1)


class HubMetadata(Record):
    """The model repo's files at one commit, as the hub listed them (every name checked: a
    tampered cache could name files outside the model dir), and the files its
    ``model.safetensors.index.json`` names (``index``; None: the repo lists no index): what
    ``sparkdeploy.model.weights.select`` decides the download from, offline too."""

    model_config = ConfigDict(extra="forbid")
    FOLDER = "model"
    PER_PROFILE = False
    WHAT = "hub metadata"
    STEP = "model.download"
    repo: str
    revision: str
    commit: str = Field(pattern=SHA1)
    files: list[HubFile]
    index: list[HubName] | None = None
    fetched_at: float = Field(ge=0, allow_inf_nan=False)

    @classmethod
    def from_bare(cls, raw: Any) -> Record | None:
        return cls.model_validate(raw)


R = TypeVar("R", bound=Record)


# --- the one reader and writer ----------------------------------------------------------------

@dataclass(frozen=True)
class Written:
    json: Path
    markdown: Path | None


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; ``|`` in a cell is escaped."""
    def cell(v: Any) -> str:
        return ("-" if v is None or v == "" else str(v)).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    msg = str(err.get("ctx", {}).get("error") or err["msg"])
    return f"{where}: {msg}" if where else msg


class Records:
    """Reads and writes the records of one deployment (one profile) under its state dir."""

    def __init__(self, state: StateDir, profile_name: str, clock: Any = time.time):
        self.state = state
        self.profile_name = profile_name
        self.clock = clock

    def path(self, kind: type[Record], name: str | None = None, suffix: str = ".json") -> Path:
        """The file of record ``name`` (default: the kind's own name) in the kind's folder (its
        profile's, for a kind kept per profile) under the state dir: every part one plain file
        name (``files.under`` refuses the rest), else a ``RecordError``. The one place a
        record's file name is made, from a profile's name or otherwise."""
        name = name or kind.NAME or ""
        parts = [self.profile_name, name] if kind.PER_PROFILE else [name]
        for part in parts:
            if not part or "/" in part or part.startswith("."):
                raise RecordError(f"bad record name {part!r}: not a plain file name")
        try:
            return under(self.state.path, "/".join([kind.FOLDER, *parts]) + suffix)
        except Escape as e:
            raise RecordError(f"bad record name {name!r}: {e}") from None

    def write(self, record: Record, name: str | None = None, *, markdown: str | None = None,
              title: str | None = None, step: str | None = None) -> Written:
        """Write ``record`` (as ``name``, for a kind that has no name of its own); ``markdown``
        is the body of the ``.md`` beside it."""
        kind = type(record)
        path = self.path(kind, name)
        when = self.clock()
        env = Envelope(name=path.stem, step=step or kind.STEP, profile=self.profile_name,
                       time=when, time_iso=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)),
                       data=record.model_dump(mode="json", by_alias=True))
        j = _atomic(path, json.dumps(redact(env.model_dump(mode="json")), indent=2, sort_keys=True) + "\n")
        md = None
        if markdown is not None:
            head = (f"# {title or env.name}\n\n"
                    f"- profile: `{self.profile_name}`\n- step: `{env.step}`\n"
                    f"- time: {env.time_iso}\n\n")
            md = _atomic(self.path(kind, name, ".md"), redact(head + markdown.rstrip() + "\n"))
        return Written(j, md)

    def read(self, kind: type[R], name: str | None = None) -> R | None:
        """Record ``name`` as its type; None when there is none yet."""
        path = self.path(kind, name)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise RecordError(f"{path}: unreadable {kind.WHAT} record "
                              f"({type(e).__name__}: {e}); move it away to start afresh") from None
        try:
            if isinstance(raw, dict) and "data" in raw and "step" in raw:
                env = Envelope.model_validate(raw)
                rec = kind.model_validate(env.data)
                rec._envelope = env
                return rec
            bare = kind.from_bare(raw)
        except ValidationError as e:
            raise RecordError(f"{path}: bad {kind.WHAT} record ({_first_error(e)}); "
                              "move it away to start afresh") from None
        if not isinstance(bare, kind):
            raise RecordError(f"{path}: bad {kind.WHAT} record (no envelope); "
                              "move it away to start afresh")
        return bare

    def remove(self, kind: type[Record], name: str | None = None) -> None:
        for suffix in (".json", ".md"):
            self.path(kind, name, suffix).unlink(missing_ok=True)


def _atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path
