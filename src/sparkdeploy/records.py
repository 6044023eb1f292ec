"""Decision records: why the tool chose what it chose, as JSON (for tools) and Markdown (for
people), under ``<state_dir>/decisions/``.

Every record carries the time it was made, the profile's name and the step that made it, so
``deploy.all`` can assemble one record of a run from the steps' records. Writes are atomic:
a killed run never leaves half a record.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkdeploy.files import write_atomic
from sparkdeploy.state import StateDir, redact

DIR = "decisions"


@dataclass(frozen=True)
class Written:
    json: Path
    markdown: Path | None


def _atomic(path: Path, text: str) -> Path:
    """A reader sees the old record or the new one, never half of one; a failed write leaves
    no temp file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(text))
    return path


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; ``|`` in a cell is escaped."""
    def cell(v: Any) -> str:
        return ("-" if v is None or v == "" else str(v)).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


class Records:
    """Reads and writes the decision records of one deployment."""

    def __init__(self, state: StateDir, profile_name: str,
                 clock: Any = time.time):
        self.state = state
        self.profile_name = profile_name
        self.clock = clock

    @property
    def dir(self) -> Path:
        return self.state.path / DIR

    def path(self, name: str, suffix: str = ".json") -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad record name {name!r}")
        return self.dir / f"{name}{suffix}"

    def write(self, name: str, step: str, data: dict[str, Any], markdown: str | None = None,
              title: str | None = None) -> Written:
        """Write record ``name`` (``data`` as JSON; ``markdown`` as the body of the .md)."""
        when = self.clock()
        envelope = {
            "name": name,
            "step": step,
            "profile": self.profile_name,
            "time": when,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)),
            "data": data,
        }
        j = _atomic(self.path(name), redact(json.dumps(envelope, indent=2, sort_keys=True)) + "\n")
        md = None
        if markdown is not None:
            head = (f"# {title or name}\n\n"
                    f"- profile: `{self.profile_name}`\n- step: `{step}`\n"
                    f"- time: {envelope['time_iso']}\n\n")
            md = _atomic(self.path(name, ".md"), redact(head + markdown.rstrip() + "\n"))
        return Written(j, md)

    def read(self, name: str) -> dict[str, Any] | None:
        """The whole envelope of record ``name`` (``["data"]`` is what the step wrote)."""
        try:
            return json.loads(self.path(name).read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def data(self, name: str) -> dict[str, Any] | None:
        env = self.read(name)
        return None if env is None else env.get("data")

    def remove(self, name: str) -> None:
        for suffix in (".json", ".md"):
            self.path(name, suffix).unlink(missing_ok=True)
