"""The one node-helper protocol: a helper staged with the ``protocol.py`` it imports (checked with
it), and ``run_helper``'s streaming form (stdin fed while it runs, progress and typed events as
they come, one typed report last) against helpers that speak through the staged protocol."""

from __future__ import annotations

import os
import sys

import pytest
from invoke import Config, Context
from pydantic import BaseModel

from sparkdeploy.core.packaged import helper
from sparkdeploy.node import nodeops
from sparkdeploy.node.hosts import Feed, Host
from sparkdeploy.profile.config import Link, Node

LOCAL = Node(name="spark1", role="head", ssh=None, privilege="none",
             link=Link(interface="e0", address="10.0.0.1"))

# A helper as the node runs it: the staged protocol imported from a directory above the staged
# helper (argv[1]), every stdin line answered with a progress line and an event, then the report.
ECHO = """import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(sys.argv[1])))
import protocol
got = []
for line in sys.stdin:
    got.append(line.strip())
    protocol.progress(bytes=len(got), total=3, file=line.strip())
    protocol.event("seen", {"line": line.strip(), "n": len(got)})
protocol.say("retry nothing (attempt 1 of 1): said on stderr, not progress")
protocol.answer({"lines": got})
"""


class Seen(BaseModel):
    line: str
    n: int


class Report(BaseModel):
    lines: list[str]


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setattr(nodeops, "STAGE_BASE", str(tmp_path))
    return Host(LOCAL, ctx=Context(Config(overrides={"run": {"dry": False}})))


def run(host: Host, code: str, **kw):
    return nodeops.run_helper(host, "model_node.py", [], result=Report, where="spark1: echo",
                              wrap=lambda path: [sys.executable, "-c", code, path], **kw)


def test_a_helper_is_staged_a_directory_below_its_protocol_and_both_are_checked(host):
    path = nodeops.stage_script(host, "memory_node.py")
    protocol = os.path.join(os.path.dirname(os.path.dirname(path)), "protocol.py")
    assert nodeops.staged_files(path) == [path, protocol]
    assert open(protocol).read() == helper("protocol.py").read_text()
    assert open(path).read() == helper("memory_node.py").read_text()
    # the staged helper runs, importing the staged protocol
    r = host.run(nodeops.verified([path], ["python3", path, "nonsense"]), change=False)
    assert (r.exit_code, r.stderr.strip()) == (2, "usage: memory_node.py read")
    # a protocol changed after staging stops every helper staged with it
    with open(protocol, "a") as f:
        f.write("\nimport os  # someone else's line\n")
    r = host.run(nodeops.verified([path], ["python3", path, "read"]), change=False)
    assert (r.exit_code, r.stderr.strip()) == (97, f"{protocol} differs from its sha256: not run")
    # staging again replaces it
    assert nodeops.stage_script(host, "memory_node.py") == path
    assert open(protocol).read() == helper("protocol.py").read_text()


def test_the_streaming_form_feeds_stdin_and_hands_on_progress_and_events_in_order(host):
    feed = Feed()
    feed.send("a\nb\n")
    feed.send("c\n")
    feed.close()
    progress: list[dict[str, str]] = []
    events: list[tuple[str, BaseModel | nodeops.HelperFailed]] = []
    lines: list[str] = []
    got = run(host, ECHO, input=feed, events={"seen": Seen}, on_event=lambda k, e: events.append((k, e)),
              on_progress=progress.append, on_line=lines.append)
    assert got == Report(lines=["a", "b", "c"])
    assert progress == [{"bytes": "1", "total": "3", "file": "a"}, {"bytes": "2", "total": "3", "file": "b"},
                        {"bytes": "3", "total": "3", "file": "c"}]
    assert events == [("seen", Seen(line="a", n=1)), ("seen", Seen(line="b", n=2)), ("seen", Seen(line="c", n=3))]
    assert lines == ["retry nothing (attempt 1 of 1): said on stderr, not progress"]


def test_an_event_that_does_not_fit_is_one_line_and_the_rest_still_comes(host):
    code = ECHO.replace('{"line": line.strip(), "n": len(got)}', '{"line": line.strip(), "n": "x" + line.strip()}')
    events: list[tuple[str, BaseModel | nodeops.HelperFailed]] = []
    got = run(host, code, input="a\n", events={"seen": Seen}, on_event=lambda k, e: events.append((k, e)))
    assert got == Report(lines=["a"])
    [(kind, bad)] = events
    assert kind == "seen" and isinstance(bad, nodeops.HelperFailed)
    assert str(bad).startswith("spark1: echo: seen: n: ") and "\n" not in str(bad)


def test_a_helper_that_dies_without_a_report_is_one_line_naming_it_and_its_last_stderr_line(host):
    code = ECHO.replace("protocol.answer(", "raise KeyError('spec')  # ")
    with pytest.raises(nodeops.HelperFailed) as e:
        run(host, code, input="a\n", events={"seen": Seen}, on_event=lambda k, e: None,
            on_progress=lambda p: None)
    assert str(e.value) == "spark1: echo: KeyError: 'spec'"
    assert "Traceback" in e.value.stderr  # kept for a caller that tells one failure from another


def test_a_helper_that_fails_says_its_error_line(host):
    code = ECHO.replace("protocol.answer({\"lines\": got})", "sys.exit(protocol.fail('no room on /srv', 3))")
    with pytest.raises(nodeops.HelperFailed) as e:
        run(host, code, input="a\n")
    assert str(e.value) == "spark1: echo: no room on /srv"


@pytest.mark.parametrize(("printed", "why"), [("", "no answer"), ("{not json", "not JSON"),
                                             ('{"lines": "a"}', "lines: ")])
def test_a_report_missing_or_malformed_is_one_line(host, printed, why):
    code = ECHO.replace("protocol.answer({\"lines\": got})", f"print({printed!r})")
    with pytest.raises(nodeops.HelperFailed) as e:
        run(host, code, input="")
    assert str(e.value).startswith("spark1: echo: ") and why in str(e.value) and "\n" not in str(e.value)


# --- the helpers' toolkit: one atomic write, one deadline, one retry ---------------------------


def test_a_helpers_atomic_write_leaves_the_old_file_or_the_new_one_and_no_part(tmp_path):
    from sparkdeploy.helpers import protocol

    rec = tmp_path / "r.json"
    rec.write_text("old")
    protocol.write_atomic(str(rec), "new", 0o640)
    assert (rec.read_text(), rec.stat().st_mode & 0o777) == ("new", 0o640)
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):  # the rename fails: the part file goes with it
        protocol.write_atomic(str(tmp_path / "d"), "x")
    assert sorted(os.listdir(tmp_path)) == ["d", "r.json"]


def test_a_helpers_deadline_and_retry_on_an_injected_clock():
    from sparkdeploy.helpers import protocol
    from tests.unit.fakes import FakeClock

    clock = FakeClock()
    d = protocol.Deadline(1.0, clock)
    assert (d.left(), d.passed()) == (1.0, False)
    clock.sleep(1.5)
    assert (d.left(), d.passed()) == (0.0, True)
    tries, said = [], []

    def attempt():
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionRefusedError("not listening")
        return "connected"

    assert protocol.retry(attempt, errors=(ConnectionRefusedError,), tries=3, pause=lambda n: 2 * n,
                          on_error=lambda n, e: said.append((n, str(e))), sleep=clock.sleep) == "connected"
    assert said == [(1, "not listening"), (2, "not listening")] and clock.sleeps[-2:] == [2, 4]
    tries.clear()
    late = protocol.Deadline(0.1, clock)
    with pytest.raises(ConnectionRefusedError):  # the deadline passed: the last error
        protocol.retry(attempt, errors=(ConnectionRefusedError,), deadline=late, pause=lambda n: 1,
                       sleep=clock.sleep)
    assert len(tries) == 1 + 1  # one try, a pause past the deadline, one more, then no more
    with pytest.raises(KeyError):  # not an error it retries: at once
        protocol.retry(lambda: {}["x"], errors=(OSError,), tries=5)
