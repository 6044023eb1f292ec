"""vLLM's own multi-node mode on the lab pair (``kind: vllm``, no Ray): serve.up --engine vllm
serves with one container per node and no Ray process in either; a worker advertising the wrong
address (the lab fault vllm-wrong-address: VLLM_HOST_IP=127.0.1.1, `hostname -i`'s answer) hangs
the head, is diagnosed worker-never-joined, and vLLM on Ray takes over. (The native pair under
persisted units, adopted, frozen and restarted: the real vLLM's module.) Leaves the lab as
test_serve_lab's fixtures do: nothing serving, no fault."""

from __future__ import annotations

import pytest

from sparkdeploy.core.records import ServeDecision
from tests.lab.test_serve_lab import (  # noqa: F401  (the fixtures)
    REPO,
    STALL,
    _wait_stream,
    clean,
    env,
    fault,
    inv,
    ours,
    profile,
    results,
    served,
    stream,
)
from tests.unit.profiles import seed_data

pytestmark = pytest.mark.lab

HEAD, WORKER = "sparkdeploy-vllm-head", "sparkdeploy-vllm-worker"


def processes(lab, node: str, name: str) -> list[str]:
    """Every process of a container, as `docker top` lists them (its command lines)."""
    cp = lab.ssh(node, ["docker", "top", name, "-eo", "pid,args"])
    return [ln.split(None, 1)[1] for ln in cp.stdout.splitlines()[1:] if len(ln.split(None, 1)) == 2]


def logs(lab, node: str, name: str) -> str:
    cp = lab.ssh(node, ["docker", "logs", name])
    return cp.stdout + cp.stderr


def native_first(tmp):
    """The seed's engines with the native mode first and vLLM on Ray as its fallback."""
    engines = {e["kind"]: e for e in seed_data()["sparkdeploy"]["engines"]}
    return profile(tmp, "native-first", engines=[engines["vllm"], engines["vllm-ray"]])


def test_the_native_pair_serves_with_no_ray_process_in_its_containers(clean):  # noqa: F811
    lab, tmp, state, prof, dep = clean
    fault(state, prof, "none")
    cp = inv(state, prof, "serve.up", "--engine", "vllm")
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr
    url = served(cp.stdout)[3].split(" ", 1)[1]
    assert url == f"http://{lab.addr('spark1', 'mgmt')}:8000"
    assert stream(url)
    assert ours(lab, "spark1") == [HEAD] and ours(lab, "spark2") == [WORKER]
    for node, name in (("spark1", HEAD), ("spark2", WORKER)):
        procs = processes(lab, node, name)
        assert procs and any("vllm serve" in p for p in procs), procs
        assert not [p for p in procs if "ray" in p.lower()], procs  # no raylet, gcs_server, ray::
    worker = logs(lab, "spark2", WORKER)
    assert "headless multiproc executor, with head node address 10.77.1.1:29501" in worker
    assert "rank 1 in world size 2 is assigned as DP rank 0, PP rank 0, TP rank 1" in worker
    head = logs(lab, "spark1", HEAD)
    assert "master_addr=10.77.1.1, mq_connect_ip=10.77.1.1 (local), world_size=2" in head
    st = inv(state, prof, "serve.status")
    assert st.returncode == 0 and f"endpoint: {url} healthy (vllm since " in st.stdout, st.stdout


def test_a_worker_advertising_the_wrong_address_hangs_is_diagnosed_and_ray_takes_over(clean):  # noqa: F811
    lab, tmp, state, prof, dep = clean
    fault(state, prof, "vllm-wrong-address")
    p = native_first(tmp)
    cp = inv(state, p, "serve.up")
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr
    out = cp.stdout
    assert "vllm hang: no log output and no readiness step" in out, out[-3000:]
    assert "class: worker-never-joined" in out and "falling back to vllm-ray" in out
    rec = dep.records.read(ServeDecision)
    [tried] = rec.tried
    assert (tried.engine, tried.diagnosis, rec.chosen) == ("vllm", "worker-never-joined", "vllm-ray")
    texts = [e[2] for e in tried.evidence]
    assert any("DP group leader" in t for t in texts) and any("Model loading took" in t for t in texts)
    assert STALL <= tried.silent_s <= STALL * 1.1
    print(f"\nvllm_native.hang_to_fallback_seconds: {tried.fallback_after_s}")
    url = served(out)[3].split(" ", 1)[1]
    assert stream(url)
    assert ours(lab, "spark1") == ["sparkdeploy-vllm-ray-api", "sparkdeploy-vllm-ray-head"]
