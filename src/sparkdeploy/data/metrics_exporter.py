"""sparkdeploy's exporter: what a node knows of the deployment, as Prometheus series.

Runs inside the serving image (``metrics.up`` starts it under the unit
``sparkdeploy-exporter.service``, ``--network=host``, read-only), where ``prometheus_client`` is
already installed: vLLM and SGLang both require it for their own ``/metrics``. It reads, at every
scrape, what the node holds, so a series is never older than the scrape:

- ``<state>/metrics/deployment.json`` (written by ``metrics.up``): the deployment, recipe, engine,
  kind, image digest and since when it serves: ``sparkdeploy_deployment_info`` and
  ``sparkdeploy_deployment_since_timestamp_seconds``;
- ``<state>/metrics/figures.json`` (the head's; ``metrics.up`` and ``bench.run`` write it): the
  last fabric test and bench: ``sparkdeploy_fabric_*``, ``sparkdeploy_bench_*``;
- ``<state>/serve/<engine>.restarts.json`` (the watchdog's records, on the head):
  ``sparkdeploy_watchdog_restarts_total`` by reason class, ``sparkdeploy_watchdog_gave_up``;
- ``<state>/swap.json`` (the head's record of the last ``serve.swap``): ``sparkdeploy_swap_phase``;
- ``/proc/meminfo``: ``sparkdeploy_node_memory_total_bytes``, ``_available_bytes`` (a Spark's
  GPU shares this memory);
- ``/sys/class/net/<interface>/statistics``: the fast link's byte, packet, error and drop counters.

No secret reaches it: the files hold none (``metrics.up`` writes names and figures only) and it
reads no environment. Standard library and ``prometheus_client`` only; Python 3.8 and newer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

LINK_COUNTERS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors",
                 "rx_dropped", "tx_dropped")
INFO_KEYS = ("deployment", "recipe", "engine", "kind", "image_digest", "role", "ranks")


def read_json(path: str) -> dict:
    """A JSON object from ``path`` ({} when it is missing or not one)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo``'s kB figures as bytes, by key."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def link_counters(iface: str, root: str = "/sys/class/net") -> dict[str, int]:
    out = {}
    for name in LINK_COUNTERS:
        try:
            with open(os.path.join(root, iface, "statistics", name)) as f:
                out[name] = int(f.read().strip())
        except (OSError, ValueError):
            continue
    return out


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class NodeCollector:
    """Every series, read afresh at each scrape."""

    def __init__(self, node: str, state: str, iface: str, proc: str = "/proc/meminfo",
                 net: str = "/sys/class/net") -> None:
        self.node, self.state, self.iface, self.proc, self.net = node, state, iface, proc, net

    def collect(self):
        dep = read_json(os.path.join(self.state, "metrics", "deployment.json"))
        yield from self._deployment(dep)
        yield from self._memory()
        yield from self._link()
        yield from self._restarts(dep)
        yield from self._figures()
        yield from self._swap(dep)

    def _deployment(self, dep: dict):
        info = GaugeMetricFamily("sparkdeploy_deployment_info",
                                 "The deployment this node serves (1 while its record is here).",
                                 labels=["node", *INFO_KEYS])
        since = GaugeMetricFamily("sparkdeploy_deployment_since_timestamp_seconds",
                                  "When the deployment's engine started serving (Unix time).",
                                  labels=["node", "deployment"])
        if dep.get("deployment"):
            info.add_metric([self.node, *(str(dep.get(k) or "") for k in INFO_KEYS)], 1)
            t = _number(dep.get("since"))
            if t is not None:
                since.add_metric([self.node, str(dep["deployment"])], t)
        yield info
        yield since

    def _memory(self):
        mem = meminfo(self.proc)
        for key, name, what in (("MemTotal", "total", "Memory the node has"),
                                ("MemAvailable", "available", "Memory the node has available")):
            g = GaugeMetricFamily(f"sparkdeploy_node_memory_{name}_bytes",
                                  f"{what} (/proc/meminfo {key}; a Spark's GPU shares it).",
                                  labels=["node"])
            if key in mem:
                g.add_metric([self.node], mem[key])
            yield g

    def _link(self):
        got = link_counters(self.iface, self.net)
        for name in LINK_COUNTERS:
            way = "receive" if name.startswith("rx") else "transmit"
            what = name.split("_", 1)[1]
            c = CounterMetricFamily(f"sparkdeploy_link_{way}_{what}",
                                    f"The fast link's {name} (/sys/class/net/IF/statistics).",
                                    labels=["node", "interface"])
            if name in got:
                c.add_metric([self.node, self.iface], got[name])
            yield c

    def _restarts(self, dep: dict):
        engine = str(dep.get("engine") or "")
        recs = []
        if engine and "/" not in engine and not engine.startswith("."):
            data = read_json(os.path.join(self.state, "serve", f"{engine}.restarts.json"))
            recs = [r for r in data.get("restarts") or [] if isinstance(r, dict)]
        by: dict = {}
        gave_up = 0
        for r in recs:
            if r.get("outcome") == "gave-up":
                gave_up = 1
                continue
            reason = str(r.get("class") or "unknown")[:64]
            by[reason] = by.get(reason, 0) + 1
        c = CounterMetricFamily("sparkdeploy_watchdog_restarts",
                                "Restarts of the whole deployment by the watchdog, by the class "
                                "of what it found (the head's records; the last few kept).",
                                labels=["node", "engine", "reason"])
        for reason, n in sorted(by.items()):
            c.add_metric([self.node, engine, reason], n)
        yield c
        g = GaugeMetricFamily("sparkdeploy_watchdog_gave_up",
                              "1 when the watchdog gave up on the deployment (its last record).",
                              labels=["node", "engine"])
        if engine and recs:
            g.add_metric([self.node, engine], gave_up if recs[-1].get("outcome") == "gave-up" else 0)
        yield g

    def _figures(self):
        figs = read_json(os.path.join(self.state, "metrics", "figures.json"))
        fab = figs.get("fabric") if isinstance(figs.get("fabric"), dict) else {}
        verdict = GaugeMetricFamily("sparkdeploy_fabric_verdict",
                                    "The last fabric test's verdict (1 for the verdict it gave).",
                                    labels=["verdict"])
        bus = GaugeMetricFamily("sparkdeploy_fabric_busbw_gbytes_per_second",
                                "The last fabric test's bus bandwidth per message size (GB/s, as "
                                "nccl-tests computes it).", labels=["bytes"])
        expected = GaugeMetricFamily("sparkdeploy_fabric_expected_gbytes_per_second",
                                     "What the link should carry, the fabric test's yardstick.")
        if fab.get("verdict"):
            verdict.add_metric([str(fab["verdict"])[:32]], 1)
            for s in fab.get("sizes") or []:
                if isinstance(s, dict) and _number(s.get("busbw_gbs")) is not None:
                    bus.add_metric([str(int(_number(s.get("bytes")) or 0))], _number(s["busbw_gbs"]))
            if _number(fab.get("expected_gbs")) is not None:
                expected.add_metric([], _number(fab["expected_gbs"]))
        yield verdict
        yield bus
        yield expected
        bench = figs.get("bench") if isinstance(figs.get("bench"), dict) else {}
        for key, name, what in (
                ("output_tok_s", "output_tokens_per_second", "output tokens per second"),
                ("ttft_ms_median", "ttft_median_milliseconds", "median time to first token (ms)"),
                ("itl_ms_median", "itl_median_milliseconds", "median inter-token latency (ms)"),
                ("time", "timestamp_seconds", "time it ended (Unix time)")):
            g = GaugeMetricFamily(f"sparkdeploy_bench_{name}",
                                  f"The last bench run's {what}, at its lowest concurrency.")
            if _number(bench.get(key)) is not None:
                g.add_metric([], _number(bench[key]))
            yield g


    def _swap(self, dep: dict):
        """The last swap's phase (the head's ``swap.json``: prepare, cut-over, done, rolled-back)."""
        g = GaugeMetricFamily("sparkdeploy_swap_phase",
                              "The last serve.swap's phase (1 for the phase it is in or ended in).",
                              labels=["node", "phase", "from_model", "to_model"])
        rec = read_json(os.path.join(self.state, "swap.json"))
        mine = not rec.get("deployment") or rec.get("deployment") == dep.get("deployment")
        if rec.get("phase") and mine:
            g.add_metric([self.node, str(rec["phase"])[:32], str(rec.get("from_model") or "")[:200],
                          str(rec.get("to_model") or "")[:200]], 1)
        yield g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="ADDRESS:PORT")
    ap.add_argument("--node", required=True)
    ap.add_argument("--state", required=True, help="the node's records (read-only)")
    ap.add_argument("--interface", required=True, help="the fast link's interface")
    a = ap.parse_args(argv)
    addr, _, port = a.listen.rpartition(":")
    if not port.isdigit():
        print(f"error: --listen {a.listen!r}: not ADDRESS:PORT", file=sys.stderr)
        return 2
    REGISTRY.register(NodeCollector(a.node, a.state, a.interface))
    try:
        start_http_server(int(port), addr=addr or "0.0.0.0")
    except OSError as e:
        print(f"error: cannot listen on {a.listen}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(json.dumps({"listening": a.listen, "node": a.node}), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
