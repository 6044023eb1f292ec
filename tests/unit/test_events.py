"""The event stream: the plain renderer's lines, progress throttling, emission from threads,
results emitted exactly once, host echo as events."""

import io
import re
import threading

from sparkdeploy.core.events import Echo, EventSink, Log, PlainRenderer, Progress, describe, renderer_for
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.node.hosts import Host
from sparkdeploy.profile.config import Link, Node
from tests.unit.fakes import FakeClock


class Out(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0
        self.at_flush: list[str] = []

    def flush(self):
        self.flushes += 1
        self.at_flush.append(self.getvalue())


def plain(out, clock, every=5.0):
    return PlainRenderer(out, progress_every=every, clock=clock, stamp=lambda: "12:00:00")


def test_plain_lines_are_timestamped_and_flushed_one_by_one():
    out, clock = Out(), FakeClock(now=100.0)
    r = plain(out, clock)
    r(Result("services.stop", Status.CHANGED, "stopped a.service", "spark1"))
    r(Echo("spark2", "docker load", would=True))
    r(Log("image.build", "spark1", "Step 2/7 : RUN pip install"))
    lines = out.getvalue().splitlines()
    assert lines == [
        "12:00:00 changed  services.stop      spark1   stopped a.service",
        "12:00:00 [spark2] would run: docker load",
        "12:00:00 [spark1] Step 2/7 : RUN pip install",
    ]
    # each line was flushed as it was written, not at the end
    assert out.flushes == 3
    assert [s.count("\n") for s in out.at_flush] == [1, 2, 3]


def test_progress_is_throttled_per_step_and_node_but_completion_always_shows():
    out, clock = Out(), FakeClock(now=100.0)
    r = plain(out, clock, every=5.0)
    gb = 1_000_000_000
    r(Progress("image.ship", "spark2", 0, 10 * gb))          # first: shown
    clock.now += 1
    r(Progress("image.ship", "spark2", 1 * gb, 10 * gb))     # 1 s later: dropped
    r(Progress("image.ship", "spark3", 1 * gb, 10 * gb))     # another node: its own clock
    clock.now += 4.5
    r(Progress("image.ship", "spark2", 5 * gb, 10 * gb))     # 5.5 s after the last shown
    clock.now += 0.1
    r(Progress("image.ship", "spark2", 6 * gb, 10 * gb))     # dropped
    r(Progress("image.ship", "spark2", 10 * gb, 10 * gb))    # complete: always shown
    lines = out.getvalue().splitlines()
    assert lines == [
        "12:00:00 ...      image.ship         [spark2] 0 B of 10.0 GB (0%)",
        "12:00:00 ...      image.ship         [spark3] 1.0 GB of 10.0 GB (10%)",
        "12:00:00 ...      image.ship         [spark2] 5.0 GB of 10.0 GB (50%)",
        "12:00:00 ...      image.ship         [spark2] 10.0 GB of 10.0 GB (100%)",
    ]


def test_progress_without_total_and_other_units():
    assert describe(Progress("bench.run", None, 3, 16, "req", "concurrency 8")) == \
        "...      bench.run          3 req of 16 req (19%) concurrency 8"
    assert describe(Progress("model.download", "spark1", 1_500_000, None)) == \
        "...      model.download     [spark1] 1.5 MB"


def test_off_a_terminal_the_renderer_is_plain():
    assert isinstance(renderer_for(io.StringIO()), PlainRenderer)


def test_events_from_many_threads_arrive_whole_and_in_each_threads_order():
    sink = EventSink()
    out = Out()
    sink.listeners.append(plain(out, FakeClock(now=100.0), every=0.0))
    n_threads, n = 8, 200

    def work(k):
        for i in range(n):
            sink.emit(Log("t", f"n{k}", f"line {i}"))

    with sink.collect() as got:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == n_threads * n
    for k in range(n_threads):
        assert [e.text for e in got if e.node == f"n{k}"] == [f"line {i}" for i in range(n)]
    lines = out.getvalue().splitlines()
    assert len(lines) == n_threads * n
    assert all(re.fullmatch(r"12:00:00 \[n\d\] line \d+", ln) for ln in lines)


def test_collect_stops_listening_after_the_block():
    sink = EventSink()
    with sink.collect() as got:
        sink.emit(Result("s", Status.FAILED, "boom"))
    sink.emit(Result("s", Status.FAILED, "later"))
    assert [e.why for e in got] == ["boom"]
    assert sink.listeners == []


def test_host_echo_is_an_event_not_stdout(capsys):
    from invoke import Config, Context

    node = Node(name="spark1", role="head", ssh=None, link=Link(interface="e0", address="10.0.0.1"),
                privilege="none")
    host = Host(node, ctx=Context(Config(overrides={"run": {"dry": True}})))
    with host.events.collect() as got:
        r = host.run(["touch", "/x y"])
    assert r.dry
    assert got == [Echo("spark1", "touch '/x y'", would=True)]
    assert capsys.readouterr().out == ""


HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\r\nnext\u202eevil\x9b"


def test_escape_sequences_from_outside_never_reach_the_terminal_plain():
    from sparkdeploy.core.events import printable

    out = io.StringIO()
    r = PlainRenderer(out, stamp=lambda: "T")
    r(Result("model.download", Status.FAILED, HOSTILE, "spark1"))
    r(Log("serve.up", "spark1", HOSTILE))
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07\r\u202e\x9b")
    assert text.count("\n") == 2  # one line per event, the payload's newline escaped
    assert printable(HOSTILE) == ("\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred\\x0d\\x0anext"
                                  "\\u202eevil\\x9b")


def test_escape_sequences_from_outside_never_reach_the_terminal_live():
    from rich.console import Console

    from sparkdeploy.core.events import LiveRenderer

    buf = io.StringIO()
    r = LiveRenderer(Console(file=buf, force_terminal=True, width=200))
    r(Result("model.download", Status.FAILED, HOSTILE, "spark1"))
    r(Log("serve.up", "spark1", HOSTILE))
    r.close()
    text = buf.getvalue()
    assert "\x1b]0;pwned" not in text and "\x1b[2J" not in text and "\u202e" not in text
    assert "\\x1b]0;pwned\\x07" in text
