"""The gateway's models on demand (``helpers/gateway.py``) on loopback, with real HTTP: each
model's engine a stand-in that a fake ``units`` object starts on its port and stops, as systemd
would its unit; ``MemAvailable`` from a file of the test's."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkdeploy.core.wait import wait_for
from sparkdeploy.helpers import gateway as gw
from sparkdeploy.lab.standins import engine_server as es
from tests.unit.test_gateway import call

GB = 10**9
NEED = 3 * GB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unit_of(model: str) -> str:
    return f"sparkdeploy-{model}-vllm.service"


class Engine(es.StandinServer):
    """An engine stand-in whose ``kill`` ends its connections too, as its process's end would."""

    def __init__(self, cfg: es.Config) -> None:
        self.conns: list[socket.socket] = []
        super().__init__(cfg)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def process_request(self, request, client_address):
        self.conns.append(request)
        super().process_request(request, client_address)

    def kill(self) -> None:
        self.shutdown()
        self.server_close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Units:
    """systemd as the gateway sees it: ``start`` serves the unit's model on its port (at once, or
    ``slow[unit]`` seconds later, active meanwhile; ``fail[unit]``: that error instead), ``stop``
    shuts it."""

    def __init__(self, models: list[str], **engine: float) -> None:
        self.where = {unit_of(m): (m, free_port()) for m in models}
        self.engine = {"ttft_ms": 1, "gap_ms": 1, **engine}
        self.servers: dict[str, Engine] = {}
        self.pending: dict[str, threading.Timer] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, str] = {}
        self.slow: dict[str, float] = {}
        self.lock = threading.Lock()

    def url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.where[unit_of(model)][1]}"

    def up(self, unit: str) -> None:
        model, port = self.where[unit]
        srv = Engine(es.Config(port=port, model=model, **self.engine))
        with self.lock:
            self.pending.pop(unit, None)
            self.servers[unit] = srv

    def down(self, unit: str) -> None:
        with self.lock:
            timer = self.pending.pop(unit, None)
            srv = self.servers.pop(unit, None)
        if timer is not None:
            timer.cancel()
        if srv is not None:
            srv.kill()

    def start(self, unit: str) -> str | None:
        self.calls.append(("start", unit))
        if unit in self.fail:
            return self.fail[unit]
        if unit in self.slow:
            timer = threading.Timer(self.slow[unit], self.up, args=(unit,))
            with self.lock:
                self.pending[unit] = timer
            timer.start()
        else:
            self.up(unit)
        return None

    def stop(self, unit: str) -> None:
        self.calls.append(("stop", unit))
        self.down(unit)

    def active(self, unit: str) -> bool:
        with self.lock:
            return unit in self.servers or unit in self.pending

    def close(self) -> None:
        for unit in list(self.pending) + list(self.servers):
            self.down(unit)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(gw, "LOAD_POLL_S", 0.02)


class Node:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.record = tmp_path / "loads.json"
        self.meminfo = tmp_path / "meminfo"
        self.memory(64 * GB)
        self.made: list[tuple[gw.Gateway, Units]] = []

    def memory(self, available: int) -> None:
        self.meminfo.write_text(f"MemTotal:       130000000 kB\nMemFree:         1000 kB\n"
                                f"MemAvailable:   {available // 1024} kB\n")

    def gateway(self, models: list[str], budget: int | None = None, wait_s: float = 2,
                load_s: float = 2, others: list[gw.Backend] | None = None,
                need: dict[str, int] | None = None, units: Units | None = None,
                **engine: float) -> tuple[gw.Gateway, Units]:
        units = units or Units(models, **engine)
        backends = [gw.Backend(units.url(m), [m], {"unit": unit_of(m),
                                                   "need_bytes": (need or {}).get(m, NEED)})
                    for m in models]
        cfg = gw.Config(backends=[*(others or []), *backends], units=units,
                        on_demand={"budget_bytes": budget, "wait_s": wait_s, "load_s": load_s,
                                   "record": str(self.record), "meminfo": str(self.meminfo)})
        g = gw.start_in_thread(cfg)
        self.made.append((g, units))
        return g, units

    def entries(self) -> list[dict]:
        return json.loads(self.record.read_text()) if self.record.exists() else []

    def events(self) -> list[tuple]:
        return [(e["event"], e["model"], *([e["for"]] if "for" in e else []))
                for e in self.entries()]

    def close(self) -> None:
        for g, units in self.made:
            g.shutdown()
            g.server_close()
            units.close()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3, **kw}


def demand(g, model: str) -> gw.Demand:
    return next(d for d in g.on_demand.demands if d.model == model)


def ask(g, model: str) -> tuple[int, dict, dict]:
    """A request for ``model``, and its end at the gateway (the client has the answer a moment
    before the gateway counts the request done: only then may the model be evicted)."""
    status, headers, data = call(g, "POST", "/v1/chat/completions", chat(model))
    d = demand(g, model)
    wait_for(lambda: d.in_flight == 0, deadline=5, interval=0.002, what=f"{model}'s request done")
    return status, headers, json.loads(data)


def metrics(g) -> str:
    return call(g, "GET", "/metrics")[2].decode()


def test_the_first_request_loads_its_model_and_is_answered(node):
    g, units = node.gateway(["m-a"])
    status, _, body = ask(g, "m-a")
    assert status == 200 and body["model"] == "m-a"
    # the engine's own answer, passed on as it came
    direct = http.client.HTTPConnection("127.0.0.1", units.where[unit_of("m-a")][1], timeout=5)
    direct.request("POST", "/v1/chat/completions", body=json.dumps(chat("m-a")),
                   headers={"Content-Type": "application/json"})
    want = json.loads(direct.getresponse().read())
    direct.close()
    text = body["choices"][0]["message"]["content"]
    assert text and text == want["choices"][0]["message"]["content"]
    assert units.calls == [("start", unit_of("m-a"))]
    [entry] = node.entries()
    assert list(entry) == ["at", "event", "model", "seconds", "evicted"]
    assert entry["event"] == "load" and entry["model"] == "m-a" and entry["evicted"] == []
    assert entry["at"].endswith("Z") and len(entry["at"]) == len("2026-01-01T00:00:00Z")
    assert 0 <= entry["seconds"] < 2
    assert stat.S_IMODE(os.stat(node.record).st_mode) == 0o644
    # loaded: the next request is forwarded at once, nothing started again
    assert ask(g, "m-a")[0] == 200 and len(units.calls) == 1


def test_a_second_model_evicts_the_first_when_the_budget_holds_one(node, capfd):
    g, units = node.gateway(["m-a", "m-b"], budget=NEED)
    assert ask(g, "m-a")[0] == 200
    status, _, body = ask(g, "m-b")
    assert status == 200 and body["model"] == "m-b"
    err = capfd.readouterr().err
    assert "gateway: evicted m-a for m-b (3.0 GB needed, 3.0 GB held, budget 3.0 GB)\n" in err
    assert "gateway: loaded m-a in 0.0s\n" in err
    assert re.search(r"^gateway: loaded m-b in \d+\.\ds \(evicted m-a\)$", err, re.M)
    assert units.calls == [("start", unit_of("m-a")), ("stop", unit_of("m-a")),
                           ("start", unit_of("m-b"))]
    assert not units.active(unit_of("m-a"))
    assert node.events() == [("load", "m-a"), ("evict", "m-a", "m-b"), ("load", "m-b")]
    evict, load = node.entries()[1:]
    assert "budget 3.0 GB" in evict["why"] and load["evicted"] == ["m-a"]
    # and back: m-a evicts m-b, and again: each load and eviction counted
    assert ask(g, "m-a")[0] == 200
    assert node.events()[-2:] == [("evict", "m-b", "m-a"), ("load", "m-a")]
    assert ask(g, "m-b")[0] == 200
    text = metrics(g)
    for line in ('sparkdeploy_gateway_loads_total{model="m-a"} 2',
                 'sparkdeploy_gateway_evictions_total{model="m-a"} 2',
                 'sparkdeploy_gateway_loads_total{model="m-b"} 2',
                 'sparkdeploy_gateway_evictions_total{model="m-b"} 1'):
        assert line in text, text


def test_the_least_recently_used_model_is_evicted_first(node):
    g, units = node.gateway(["m-a", "m-b", "m-c"], budget=2 * NEED)
    for model in ("m-a", "m-b", "m-a"):  # m-b is now the least recently used
        assert ask(g, model)[0] == 200
    assert ask(g, "m-c")[0] == 200
    assert node.events()[2:] == [("evict", "m-b", "m-c"), ("load", "m-c")]
    assert units.active(unit_of("m-a")) and not units.active(unit_of("m-b"))
    assert ask(g, "m-a")[0] == 200  # still loaded: answered without a load
    assert ask(g, "m-b")[0] == 200  # evicts m-c, now the least recently used
    assert node.events()[4:] == [("evict", "m-c", "m-b"), ("load", "m-b")]


def test_a_model_with_a_request_in_flight_is_not_evicted(node):
    g, units = node.gateway(["m-a", "m-b"], budget=NEED, gap_ms=60)
    assert ask(g, "m-a")[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps(chat("m-a", max_tokens=12, stream=True, ignore_eos=True)))
    r = conn.getresponse()
    assert r.status == 200 and r.read1(65536)  # m-a's stream has begun: a request in flight
    status, headers, body = ask(g, "m-b")
    assert status == 503 and headers["Retry-After"] == "10"
    err = body["error"]
    assert err["type"] == "ServiceUnavailable" and err["code"] == 503
    assert "`m-b`" in err["message"] and "could not be loaded" in err["message"]
    assert "no room" in err["message"]
    rest = r.read()  # m-a's stream ends well
    conn.close()
    assert rest.rstrip().endswith(b"data: [DONE]")
    wait_for(lambda: demand(g, "m-a").in_flight == 0, deadline=5, interval=0.002,
             what="m-a's stream done")
    assert units.calls == [("start", unit_of("m-a"))] and units.active(unit_of("m-a"))
    assert node.events() == [("load", "m-a"), ("load-failed", "m-b")]
    # once m-a is idle, m-b fits by evicting it
    assert ask(g, "m-b")[0] == 200
    assert node.events()[2:] == [("evict", "m-a", "m-b"), ("load", "m-b")]


def test_a_request_waits_wait_s_then_a_503_and_the_load_goes_on(node):
    g, units = node.gateway(["m-a"], wait_s=0.2, load_s=5)
    units.slow[unit_of("m-a")] = 0.8
    t0 = time.monotonic()
    status, headers, body = ask(g, "m-a")
    assert 0.2 <= time.monotonic() - t0 < 0.75
    assert status == 503 and headers["Retry-After"] == "1"  # never loaded: wait_s, at least 1
    msg = body["error"]["message"]
    assert body["error"]["type"] == "ServiceUnavailable"
    assert "`m-a`" in msg and "loading on demand" in msg
    assert 'sparkdeploy_gateway_unavailable_total{model="m-a"} 1' in metrics(g)
    assert ask(g, "m-a")[0] == 503  # still loading: the second counted too
    assert 'sparkdeploy_gateway_unavailable_total{model="m-a"} 2' in metrics(g)
    # the load went on without the request
    wait_for(lambda: node.events() == [("load", "m-a")], deadline=3, interval=0.02,
             what="the load")
    assert ask(g, "m-a")[0] == 200
    assert units.calls == [("start", unit_of("m-a"))]


def test_retry_after_is_the_last_load_less_what_this_one_has_run(node):
    od = gw.OnDemand(gw.Config(backends=[gw.Backend("http://127.0.0.1:9", ["m"],
                                                    {"unit": "m.service", "need_bytes": 1})],
                               units=Units([]), on_demand={"wait_s": 2.5}))
    d = od.demands[0]
    assert od._retry_after(d) == 3  # never loaded: wait_s
    d.last_load_s = 31.2
    assert od._retry_after(d) == 32  # this load queued, not begun
    d.load_started = time.monotonic() - 10
    assert od._retry_after(d) == 22
    d.load_started = time.monotonic() - 40
    assert od._retry_after(d) == 1


def test_a_start_that_fails_is_a_503_naming_why(node):
    g, units = node.gateway(["m-a"])
    units.fail[unit_of("m-a")] = "Job for sparkdeploy-m-a-vllm.service failed (exit 1)"
    status, headers, body = ask(g, "m-a")
    assert status == 503 and headers["Retry-After"] == "10"
    assert "Job for sparkdeploy-m-a-vllm.service failed" in body["error"]["message"]
    [entry] = node.entries()
    assert entry["event"] == "load-failed" and "Job for" in entry["why"]
    assert units.calls == [("start", unit_of("m-a")), ("stop", unit_of("m-a"))]  # what it left, gone
    text = metrics(g)
    assert 'sparkdeploy_gateway_load_failures_total{model="m-a"} 1' in text
    assert 'sparkdeploy_gateway_loaded{model="m-a"} 0' in text
    del units.fail[unit_of("m-a")]  # fixed: the next request loads it
    assert ask(g, "m-a")[0] == 200
    assert node.events() == [("load-failed", "m-a"), ("load", "m-a")]


def test_a_load_past_load_s_fails_and_its_unit_is_stopped(node):
    g, units = node.gateway(["m-a"], wait_s=2, load_s=0.3)
    units.slow[unit_of("m-a")] = 5  # never answers in time
    status, headers, body = ask(g, "m-a")
    assert status == 503 and headers["Retry-After"] == "10"
    assert "within 0.3 s" in body["error"]["message"]
    assert units.calls == [("start", unit_of("m-a")), ("stop", unit_of("m-a"))]
    assert node.events() == [("load-failed", "m-a")]


def test_models_lists_a_model_not_loaded_without_asking_its_engine(node):
    always = es.start_in_thread(es.Config(port=0, model="m-x", ttft_ms=1, gap_ms=1))
    units = Units(["m-a"])
    watch = socket.socket()  # m-a's port: whoever connects is seen
    watch.bind(("127.0.0.1", units.where[unit_of("m-a")][1]))
    watch.listen(8)
    watch.settimeout(0.2)
    try:
        g, _ = node.gateway(["m-a"], units=units,
                            others=[gw.Backend(f"http://127.0.0.1:{always.port}")])
        status, headers, data = call(g, "GET", "/v1/models")
        assert status == 200 and "X-Sparkdeploy-Unreachable" not in headers
        assert json.loads(data)["data"] == [
            {"id": "m-x", "object": "model", "created": 0, "owned_by": "standin", "root": "m-x"},
            {"id": "m-a", "object": "model", "created": 0, "owned_by": "sparkdeploy"}]
        with pytest.raises(TimeoutError):
            watch.accept()
    finally:
        watch.close()
        always.shutdown()
        always.server_close()
    assert ask(g, "m-a")[0] == 200
    _, _, data = call(g, "GET", "/v1/models")  # loaded: its engine is asked
    assert [m["owned_by"] for m in json.loads(data)["data"]] == ["standin"]


def test_metrics_show_each_model_on_demand(node):
    g, units = node.gateway(["m-a", "m-b"], budget=NEED)
    text = metrics(g)
    assert "# TYPE sparkdeploy_gateway_loaded gauge" in text
    assert 'sparkdeploy_gateway_loaded{model="m-a"} 0' in text
    assert "sparkdeploy_gateway_last_load_seconds{" not in text  # never loaded
    assert ask(g, "m-a")[0] == 200 and ask(g, "m-b")[0] == 200
    text = metrics(g)
    for line in ('sparkdeploy_gateway_loaded{model="m-a"} 0',
                 'sparkdeploy_gateway_loaded{model="m-b"} 1',
                 'sparkdeploy_gateway_loads_total{model="m-a"} 1',
                 'sparkdeploy_gateway_loads_total{model="m-b"} 1',
                 'sparkdeploy_gateway_evictions_total{model="m-a"} 1',
                 'sparkdeploy_gateway_evictions_total{model="m-b"} 0',
                 'sparkdeploy_gateway_load_failures_total{model="m-b"} 0',
                 'sparkdeploy_gateway_unavailable_total{model="m-b"} 0',
                 "# TYPE sparkdeploy_gateway_loads_total counter",
                 "# HELP sparkdeploy_gateway_evictions_total ",
                 "# TYPE sparkdeploy_gateway_last_load_seconds gauge",
                 'sparkdeploy_gateway_requests_total{model="m-b"} 1'):
        assert line in text, line
    seconds = {line.split("{")[1].split()[0]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("sparkdeploy_gateway_last_load_seconds{")}
    assert set(seconds) == {'model="m-a"}', 'model="m-b"}'} and all(0 <= v < 2 for v in seconds.values())


def test_memory_short_of_the_need_evicts_one_more(node):
    g, units = node.gateway(["m-a", "m-b", "m-c"], budget=3 * NEED, need={"m-c": 2 * NEED})
    assert ask(g, "m-a")[0] == 200 and ask(g, "m-b")[0] == 200
    node.memory(GB)  # the budget makes m-c evict m-a; memory, m-b too
    assert ask(g, "m-c")[0] == 200
    assert node.events()[2:] == [("evict", "m-a", "m-c"), ("evict", "m-b", "m-c"),
                                 ("load", "m-c")]
    assert "MemAvailable 1.0 GB" in node.entries()[2]["why"]
    assert node.entries()[-1]["evicted"] == ["m-a", "m-b"]
    node.memory(NEED * 10)
    assert ask(g, "m-a")[0] == 200  # within memory and budget: nothing evicted
    assert node.events()[-1:] == [("load", "m-a")] and units.active(unit_of("m-c"))


def test_a_unit_active_at_the_start_is_loaded_without_a_record(node):
    units = Units(["m-a", "m-b"])
    units.up(unit_of("m-a"))
    g, _ = node.gateway(["m-a", "m-b"], units=units)
    assert 'sparkdeploy_gateway_loaded{model="m-a"} 1' in metrics(g)
    assert ask(g, "m-a")[0] == 200
    assert units.calls == [] and node.entries() == []


def test_a_unit_active_at_the_start_still_loading_is_waited_for(node):
    units = Units(["m-a"])
    units.slow[unit_of("m-a")] = 0.3
    units.start(unit_of("m-a"))  # active, its engine not answering yet
    g, _ = node.gateway(["m-a"], units=units)
    assert 'sparkdeploy_gateway_loaded{model="m-a"} 0' in metrics(g)
    assert ask(g, "m-a")[0] == 200  # waits for the engine, starts nothing
    assert units.calls == [("start", unit_of("m-a"))] and node.entries() == []


def test_an_engine_gone_is_no_longer_loaded(node):
    g, units = node.gateway(["m-a"])
    assert ask(g, "m-a")[0] == 200
    units.down(unit_of("m-a"))  # the engine died: its unit is not active
    assert ask(g, "m-a")[0] == 502
    assert 'sparkdeploy_gateway_loaded{model="m-a"} 0' in metrics(g)  # as the 502 was sent
    assert ask(g, "m-a")[0] == 200  # loaded again
    assert node.events() == [("load", "m-a"), ("load", "m-a")]


def test_an_engine_unreachable_while_its_unit_runs_stays_loaded(node):
    g, units = node.gateway(["m-a"])
    assert ask(g, "m-a")[0] == 200
    units.servers[unit_of("m-a")].kill()  # the engine does not answer; its unit is still active
    assert ask(g, "m-a")[0] == 502
    assert 'sparkdeploy_gateway_loaded{model="m-a"} 1' in metrics(g)
    assert units.calls == [("start", unit_of("m-a"))]  # no load again, no stop


def test_two_requests_waiting_for_one_load_keep_their_model_from_eviction(node):
    g, units = node.gateway(["m-a", "m-b"], budget=NEED, wait_s=3, load_s=5)
    assert ask(g, "m-a")[0] == 200
    d = demand(g, "m-a")
    gw_od = g.on_demand
    gw_od.enter(d, None)
    gw_od.enter(d, None)
    gw_od.leave(d)  # one of the two ends: the other is in flight still
    assert d.in_flight == 1
    status, _, body = ask(g, "m-b")
    assert status == 503 and "no room" in body["error"]["message"]
    gw_od.leave(d)
    assert ask(g, "m-b")[0] == 200


def test_the_program_reads_on_demand_from_its_config(node, tmp_path, capsys):
    units = Units(["m-a"])
    config = tmp_path / "gateway.json"
    doc = {"listen": "127.0.0.1:0",
           "backends": [{"url": units.url("m-a"), "models": ["m-a"],
                         "on_demand": {"unit": unit_of("m-a"), "need_bytes": NEED}}],
           "on_demand": {"budget_bytes": None, "wait_s": 5, "load_s": 7, "record": "r.json",
                         "systemctl": ["sudo", "systemctl"], "meminfo": str(node.meminfo)}}
    config.write_text(json.dumps(doc))
    ns = argparse.Namespace(config=str(config), listen=None, backend=None, quiet=True)
    cfg = gw.load_config(ns)
    [b] = cfg.backends
    assert (b.unit, b.need_bytes, b.static) == (unit_of("m-a"), NEED, ["m-a"])
    assert (cfg.budget_bytes, cfg.wait_s, cfg.load_s, cfg.record, cfg.meminfo) == (
        None, 5.0, 7.0, "r.json", str(node.meminfo))
    assert isinstance(cfg.units, gw.Systemctl) and cfg.units.argv == ["sudo", "systemctl"]
    doc["backends"][0]["on_demand"]["unit"] = "x.service; reboot"  # type: ignore[index]
    config.write_text(json.dumps(doc))
    assert gw.main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "on_demand.unit" in err


def od_backend(**spec) -> gw.Backend:
    return gw.Backend("http://127.0.0.1:9", spec.pop("models", ["m"]),
                      {"unit": "m.service", "need_bytes": 1, **spec})


@pytest.mark.parametrize("make, key", [
    (lambda: od_backend(unit="m.socket"), "on_demand.unit"),
    (lambda: od_backend(unit="a b.service"), "on_demand.unit"),
    (lambda: od_backend(unit="m.service\n"), "on_demand.unit"),
    (lambda: od_backend(unit=None), "on_demand.unit"),
    (lambda: od_backend(need_bytes=0), "on_demand.need_bytes"),
    (lambda: od_backend(need_bytes=-5), "on_demand.need_bytes"),
    (lambda: od_backend(need_bytes=1.5), "on_demand.need_bytes"),
    (lambda: od_backend(need_bytes=True), "on_demand.need_bytes"),
    (lambda: od_backend(need_bytes="3"), "on_demand.need_bytes"),
    (lambda: od_backend(size=1), "unknown key 'size'"),
    (lambda: od_backend(models=[]), "models"),
    (lambda: od_backend(models=["a", "b"]), "models"),
    (lambda: gw.Backend("http://127.0.0.1:9", ["m"], {"unit": "m.service"}),
     "on_demand.need_bytes"),
    (lambda: gw.Backend("http://127.0.0.1:9", ["m"], ["m.service"]), "on_demand: not an object"),
    (lambda: gw.Config(on_demand={"budget_bytes": 0}), "on_demand.budget_bytes"),
    (lambda: gw.Config(on_demand={"budget_bytes": "8G"}), "on_demand.budget_bytes"),
    (lambda: gw.Config(on_demand={"wait_s": 0}), "on_demand.wait_s"),
    (lambda: gw.Config(on_demand={"wait_s": "60"}), "on_demand.wait_s"),
    (lambda: gw.Config(on_demand={"load_s": -1}), "on_demand.load_s"),
    (lambda: gw.Config(on_demand={"load_s": None}), "on_demand.load_s"),
    (lambda: gw.Config(on_demand={"record": 3}), "on_demand.record"),
    (lambda: gw.Config(on_demand={"meminfo": ""}), "on_demand.meminfo"),
    (lambda: gw.Config(on_demand={"systemctl": "systemctl"}), "on_demand.systemctl"),
    (lambda: gw.Config(on_demand={"systemctl": []}), "on_demand.systemctl"),
    (lambda: gw.Config(on_demand={"budget": 1}), "unknown key 'budget'"),
    (lambda: gw.Config(on_demand=[]), "on_demand: not an object"),  # type: ignore[arg-type]
    (lambda: gw.Config(backends=[od_backend(), od_backend(models=["n"])]), "unit 'm.service'"),
    (lambda: gw.Config(backends=[od_backend(), od_backend(unit="n.service")]), "model 'm'"),
])
def test_bad_on_demand_values_are_refused_naming_the_key(make, key):
    with pytest.raises(ValueError) as e:
        make()
    assert key in str(e.value)


def test_good_on_demand_values_are_taken():
    b = od_backend(unit="sparkdeploy-q@x_1:a-vllm.service", need_bytes=3328599654)
    cfg = gw.Config(backends=[b], on_demand={"budget_bytes": 8 * GB, "wait_s": 1, "load_s": 0.5})
    assert (b.unit, b.need_bytes, cfg.budget_bytes, cfg.wait_s, cfg.load_s) == (
        "sparkdeploy-q@x_1:a-vllm.service", 3328599654, 8 * GB, 1.0, 0.5)
    assert cfg.record is None and cfg.meminfo == "/proc/meminfo"
    assert isinstance(cfg.units, gw.Systemctl) and cfg.units.argv == ["systemctl"]


def test_systemctl_is_run_as_argv_never_a_shell(tmp_path):
    log = tmp_path / "argv"
    fake = tmp_path / "systemctl.py"
    fake.write_text("import sys\n"
                    f"open({str(log)!r}, 'a').write(repr(sys.argv[1:]) + '\\n')\n"
                    "verb, unit = sys.argv[1], sys.argv[3]\n"
                    "if unit.startswith('bad'):\n"
                    "    print('first line', file=sys.stderr)\n"
                    "    print('Job for bad.service failed.', file=sys.stderr)\n"
                    "    sys.exit(1 if verb == 'start' else 3)\n")
    units = gw.Systemctl([sys.executable, str(fake)])
    assert units.start("good.service") is None
    assert units.start("bad.service") == ("systemctl start bad.service: exit 1: "
                                         "Job for bad.service failed.")
    assert units.active("good.service") and not units.active("bad.service")
    units.stop("good.service")
    assert log.read_text().splitlines() == [
        "['start', '--', 'good.service']", "['start', '--', 'bad.service']",
        "['is-active', '--', 'good.service']", "['is-active', '--', 'bad.service']",
        "['stop', '--', 'good.service']"]
    missing = gw.Systemctl([str(tmp_path / "nowhere")])
    assert "nowhere" in (missing.start("x.service") or "") and not missing.active("x.service")


def test_the_record_keeps_the_last_200_and_survives_a_failed_write(tmp_path, capfd):
    rec = gw.Record(str(tmp_path / "loads.json"))
    for i in range(205):
        rec.add({"event": "load", "model": f"m{i}"})
    entries = json.loads((tmp_path / "loads.json").read_text())
    assert len(entries) == 200 and entries[0]["model"] == "m5" and entries[-1]["model"] == "m204"
    assert all(list(e)[0] == "at" for e in entries)
    assert [p.name for p in tmp_path.iterdir()] == ["loads.json"]  # no temporary file left
    (tmp_path / "loads.json").write_text("not json")
    rec.add({"event": "evict", "model": "x"})
    assert [e["model"] for e in json.loads((tmp_path / "loads.json").read_text())] == ["x"]
    gone = gw.Record(str(tmp_path / "no" / "loads.json"))
    gone.add({"event": "load", "model": "m"})  # not raised
    gone.add({"event": "load", "model": "m"})
    err = capfd.readouterr().err
    assert err.count("gateway: the record ") == 2 and "no/loads.json" in err
    gw.Record(None).add({"event": "load", "model": "m"})  # no record: nothing written


def test_mem_available_is_read_in_bytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert gw.mem_available(str(f)) == 2048 * 1024
    f.write_text("MemTotal: 100 kB\n")
    assert gw.mem_available(str(f)) is None
    f.write_text("MemAvailable: lots kB\n")
    assert gw.mem_available(str(f)) is None
    assert gw.mem_available(str(tmp_path / "none")) is None


def held(model: str, need: int = 4, last_used: float = 0.0, in_flight: int = 0,
         loaded: bool = True) -> gw.Held:
    return gw.Held(model, need, last_used, in_flight, loaded)


@pytest.mark.parametrize("need, budget, available, others, want", [
    # nothing held, no limits
    (4, None, None, [], []),
    (4, None, None, [held("a")], []),
    # the budget alone: the least recently used first, as many as it takes
    (4, 8, None, [held("a", last_used=2), held("b", last_used=1)], ["b"]),
    (4, 4, None, [held("a", last_used=2), held("b", last_used=1)], ["b", "a"]),
    (4, 12, None, [held("a", last_used=2), held("b", last_used=1)], []),  # exactly the budget
    (5, 12, None, [held("a", last_used=2), held("b", last_used=1)], ["b"]),  # one byte over
    (4, 3, None, [], None),  # never fits
    (4, 3, None, [held("a")], None),
    # memory alone: what is available plus what the evicted held
    (4, None, 4, [held("a")], []),  # exactly what is available
    (5, None, 4, [held("a", need=1)], ["a"]),  # 4 + 1: exactly
    (6, None, 4, [held("a", need=1)], None),
    (6, None, 4, [held("a", need=1, last_used=1), held("b", need=1, last_used=2)], ["a", "b"]),
    (4, None, 0, [held("a", need=3, last_used=5), held("b", need=1, last_used=9)], ["a", "b"]),
    # both: the budget wants one, memory a second
    (4, 8, 1, [held("a", last_used=1), held("b", last_used=2)], ["a"]),
    (4, 8, 0, [held("a", last_used=1), held("b", last_used=2)], ["a"]),
    (4, 5, None, [held("a", need=1, last_used=1), held("b", need=1, last_used=2)], ["a"]),
    (4, 5, 2, [held("a", need=1, last_used=1), held("b", need=1, last_used=2)], ["a", "b"]),
    (4, 5, 3, [held("a", need=1, last_used=1), held("b", need=1, last_used=2)], ["a"]),
    (4, 12, 1, [held("a", last_used=1), held("b", last_used=2)], ["a"]),  # memory alone
    # in flight or loading: held, never evicted
    (4, 8, None, [held("a", last_used=1, in_flight=1), held("b", last_used=2)], ["b"]),
    (4, 4, None, [held("a", last_used=1, in_flight=1), held("b", last_used=2)], None),
    (4, 8, None, [held("a", last_used=1, loaded=False), held("b", last_used=2)], ["b"]),
    (4, 4, None, [held("a", loaded=False)], None),
    (4, None, 3, [held("a", in_flight=2)], None),
    (4, None, 3, [held("a", loaded=False)], None),
])
def test_evict_order(need, budget, available, others, want):
    assert gw.evict_order(need, budget, available, others) == want


def test_evict_order_keeps_the_given_order_between_equals():
    assert gw.evict_order(4, 4, None, [held("b"), held("a")]) == ["b", "a"]
    assert gw.evict_order(4, 8, None, [held("b"), held("a")]) == ["b"]
