"""What the lab gives a node besides the engines: the fault record and its node copies, the
NVIDIA runtime stand-in (hook and runtime), the GPU-user marker nvidia-smi honours."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkdeploy.lab import faults, layout
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.lab.standins import nodeinstall as install

STANDINS = Path(install.__file__).parent


def _load(name):
    path = STANDINS / name
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


@pytest.fixture
def lab_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "NODES_DIR", tmp_path / "nodes")
    monkeypatch.setattr(layout, "LAB_DIR", tmp_path)
    for n in ("spark1", "spark2"):
        (tmp_path / "nodes" / n).mkdir(parents=True)
    return tmp_path


def test_fault_set_lasts_and_none_clears_on_every_node(lab_dirs):
    rec = lab_dirs / "faults.json"
    [r] = faults.set_fault("sglang-hang", rec)
    assert r.status == "changed" and faults.current(rec) == ["sglang-hang"]
    assert "one already serving keeps serving (`inv serve.down` first" in r.why
    for n in ("spark1", "spark2"):
        view = faults.view_dir(n)
        assert view == lab_dirs / "nodes" / n / "standins" / "container"
        assert es.lab_faults(str(view)) == {"sglang-hang"}
    [again] = faults.set_fault("sglang-hang", rec)
    assert again.status == "ok"
    [cleared] = faults.set_fault("none", rec)
    assert cleared.status == "changed" and faults.current(rec) == []
    assert es.lab_faults(str(faults.view_dir("spark2"))) == set()


def test_unknown_fault_names_the_argument(lab_dirs):
    [r] = faults.set_fault("gpu-melt", lab_dirs / "faults.json")
    assert r.failed and r.why.startswith("NAME: unknown fault 'gpu-melt'")
    assert not (lab_dirs / "faults.json").exists()


def test_rank_wedged_stops_every_process_of_the_nodes_engine_containers_and_none_continues_them(
        lab_dirs, monkeypatch):
    rec = lab_dirs / "faults.json"
    calls, kills = [], []
    state = {}

    def run(argv, **kw):
        calls.append(argv)
        out = "sparkdeploy-sglang-worker\n" if "ps" in argv else "4242\n"
        return subprocess.CompletedProcess(argv, 0, out, "")

    def kill(pid, sig):
        kills.append((pid, sig))
        state[pid] = "T" if sig == faults.signal.SIGSTOP else "S"

    monkeypatch.setattr(faults.subprocess, "run", run)
    monkeypatch.setattr(faults.os, "kill", kill)
    monkeypatch.setattr(faults.wd, "process_tree", lambda pid: {pid: "S", pid + 1: "S"})
    monkeypatch.setattr(faults.wd, "proc_stat", lambda pid: (state[pid], 1) if pid in state else None)
    [r] = faults.set_fault("rank-wedged", rec, node="spark2")
    sock = f"unix://{layout.docker_socket('spark2')}"
    assert calls == [["docker", "-H", sock, "ps", "--filter", "label=org.sparkdeploy.engine",
                      "--format", "{{.Names}}"],
                     ["docker", "-H", sock, "inspect", "--format", "{{.State.Pid}}",
                      "sparkdeploy-sglang-worker"]]
    assert kills == [(4242, faults.signal.SIGSTOP), (4243, faults.signal.SIGSTOP)]
    assert r.status == "changed" and r.why.startswith("rank-wedged on spark2: every process")
    assert json.loads(rec.read_text())["stopped"] == {"spark2": [4242, 4243]}
    state[4243] = "S"  # continued by someone else meanwhile: left alone
    kills.clear()
    [c] = faults.set_fault("none", rec)
    assert kills == [(4242, faults.signal.SIGCONT)]
    assert "continued 1 stopped process(es)" in c.why and "stopped" not in json.loads(rec.read_text())


def test_rank_exit_kills_the_engine_process_only(lab_dirs, monkeypatch):
    kills = []
    monkeypatch.setattr(faults.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 0, "sparkdeploy-sglang-head\n" if "ps" in argv else "77\n", ""))
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    [r] = faults.set_fault("rank-exit", lab_dirs / "faults.json", node="spark1")
    assert kills == [(77, faults.signal.SIGKILL)] and r.status == "changed"
    assert not (lab_dirs / "faults.json").exists()  # nothing to undo


def test_an_action_on_a_node_without_an_engine_fails(lab_dirs, monkeypatch):
    monkeypatch.setattr(faults.subprocess, "run",
                        lambda argv, **kw: subprocess.CompletedProcess(argv, 0, "", ""))
    [r] = faults.set_fault("rank-wedged", lab_dirs / "faults.json", node="spark2")
    assert r.failed and r.why == "spark2: no engine container running"


def test_lab_fault_task_exits_2_on_a_bad_name():
    cp = subprocess.run([sys.executable, "-m", "invoke", "lab.fault", "nope"], capture_output=True,
                        text=True, cwd=Path(__file__).resolve().parents[2],
                        env={**os.environ, "PYTHONPATH": str(Path(es.__file__).resolve().parents[3])})
    assert cp.returncode == 2 and "NAME: unknown fault 'nope'" in cp.stderr


def test_copy_files_puts_executables_in_bin_and_modules_in_lib(tmp_path):
    did = install.copy_files(tmp_path)
    bins = sorted(p.name for p in (tmp_path / "bin").iterdir())
    assert bins == ["nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-smi", "systemctl"]
    assert [p.name for p in (tmp_path / "runtime").iterdir()] == ["runc"]  # alone: first on dockerd's PATH
    assert all(os.access(tmp_path / "bin" / b, os.X_OK) for b in bins)
    libs = sorted(p.name for p in (tmp_path / "lib").iterdir())
    assert "nodeinstall.py" not in libs and "__init__.py" not in libs and "engine_server.py" in libs
    assert did and install.copy_files(tmp_path) == []


def test_default_route_gateway_is_an_unused_management_address():
    assert install.gateway("10.77.0.0/24") == "10.77.0.254"
    assert install.global_v6("spark2") == ["fd00:77:1::2"] and install.global_v6("spark1") == []


def test_hook_accepts_all_and_the_gpu_refuses_unknown_devices(monkeypatch, tmp_path):
    hook = _load("nvidia-container-runtime-hook")
    monkeypatch.setattr(hook, "ROOT", tmp_path)
    (tmp_path / "gpu-uuid").write_text("GPU-abc\n")
    assert hook.wanted({}) is None and hook.wanted({"NVIDIA_VISIBLE_DEVICES": "void"}) is None
    assert hook.wanted({"NVIDIA_VISIBLE_DEVICES": "all"}) == ""
    assert hook.wanted({"NVIDIA_VISIBLE_DEVICES": "GPU-abc"}) == ""
    assert hook.wanted({"NVIDIA_VISIBLE_DEVICES": "1"}) == "nvidia-container-cli: device error: 1: unknown device"


def test_hook_mounts_smi_roce_and_the_lab_view(monkeypatch, tmp_path):
    hook = _load("nvidia-container-runtime-hook")
    lab = tmp_path / "lab"
    (lab / "bin").mkdir(parents=True)
    (lab / "bin" / "nvidia-smi").write_text("#!/bin/sh\n")
    (lab / "sysfs" / "infiniband").mkdir(parents=True)
    (lab / "container").mkdir()
    monkeypatch.setattr(hook, "LAB", lab)
    monkeypatch.setattr(hook, "ROOT", tmp_path / "root")
    cmds = hook.mounts("/R", "cid1")
    assert ["mount", "--bind", "-o", "ro", f"{lab}/bin/nvidia-smi", "/R/usr/bin/nvidia-smi"] in cmds
    assert ["mount", "-t", "overlay", "sparkdeploy-roce", "-o",
            f"ro,lowerdir={lab}/sysfs:/R/sys/class", "/R/sys/class"] in cmds
    assert cmds[-2:] == [["mount", "--bind", "-o", "ro", f"{lab}/container", "/R/run/sparkdeploy-lab"],
                         ["mount", "--bind", f"{tmp_path}/root/gpu-containers/cid1",
                          "/R/run/sparkdeploy-lab/gpu"]]


def test_runtime_adds_the_prestart_hook_once(tmp_path):
    rt = _load("nvidia-container-runtime")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"process": {"args": ["sh"]}}))
    assert rt.bundle_of(["--root", "x", "create", "--bundle", str(tmp_path), "id"]) == tmp_path
    rt.add_hook(cfg, "/lab/bin/nvidia-container-runtime-hook")
    rt.add_hook(cfg, "/lab/bin/nvidia-container-runtime-hook")
    pre = json.loads(cfg.read_text())["hooks"]["prestart"]
    assert len(pre) == 1 and pre[0]["args"] == ["nvidia-container-runtime-hook", "prestart"]


def test_nvidia_smi_lists_a_gpu_container_only_once_its_engine_holds_the_gpu(monkeypatch, tmp_path):
    smi = _load("nvidia-smi")
    monkeypatch.setattr(smi, "ROOT", tmp_path)
    (tmp_path / "gpu-users").mkdir()
    marker = tmp_path / "gpu-containers" / "c1" / "cuda"
    marker.parent.mkdir(parents=True)
    me = os.getpid()
    start = Path(f"/proc/{me}/stat").read_text().rsplit(")", 1)[1].split()[19]
    (tmp_path / "gpu-users" / str(me)).write_text(f"python3\n{start}\n{marker}\n")
    assert smi.gpu_users() == []
    assert es.hold_gpu("VLLM::EngineCore", str(marker.parent.parent.parent / "view-missing")) is False
    view = tmp_path / "view"
    view.mkdir()
    (view / "gpu").symlink_to(marker.parent)
    assert es.hold_gpu("VLLM::EngineCore", str(view)) is True
    assert smi.gpu_users() == [(me, "VLLM::EngineCore")]


def test_runc_standin_lowers_rlimits_to_what_the_machine_allows_and_finds_the_real_runc():
    rc = _load("runc")
    rl = [{"type": "RLIMIT_MEMLOCK", "hard": 2**64 - 1, "soft": 2**64 - 1},
          {"type": "RLIMIT_STACK", "hard": 67108864, "soft": 67108864},
          {"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
    caps = {"RLIMIT_MEMLOCK": 8388608, "RLIMIT_STACK": 2**64 - 1, "RLIMIT_NOFILE": 4096}
    assert rc.clamp(rl, caps.get) is True
    assert rl == [{"type": "RLIMIT_MEMLOCK", "hard": 8388608, "soft": 8388608},
                  {"type": "RLIMIT_STACK", "hard": 67108864, "soft": 67108864},
                  {"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
    assert rc.clamp(rl, caps.get) is False
    real = rc.real_runc()
    assert real is None or Path(real).resolve() != (STANDINS / "runc").resolve()


def test_runc_standin_lowers_the_rlimits_of_an_exec_process_too(tmp_path, monkeypatch):
    # `docker exec` into a container run with --ulimit memlock=-1 hands runc the same rlimits
    rc = _load("runc")
    monkeypatch.setattr(rc, "machine_hard", {"RLIMIT_MEMLOCK": 8388608}.get)
    proc = tmp_path / "process.json"
    proc.write_text(json.dumps({"args": ["python3"], "rlimits": [
        {"type": "RLIMIT_MEMLOCK", "hard": 2**64 - 1, "soft": 2**64 - 1}]}))
    args = ["--root", "/r", "exec", "--process", str(proc), "--detach", "cid"]
    assert rc.process_of(args) == proc
    assert rc.process_of(["exec", f"--process={proc}", "cid"]) == proc
    assert rc.process_of(["create", "--bundle", "/b", "cid"]) is None
    rc.lower(proc, inner=False)
    assert json.loads(proc.read_text()) == {"args": ["python3"], "rlimits": [
        {"type": "RLIMIT_MEMLOCK", "hard": 8388608, "soft": 8388608}]}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"process": {"rlimits": [
        {"type": "RLIMIT_MEMLOCK", "hard": 2**64 - 1, "soft": 0}]}}))
    rc.lower(cfg, inner=True)
    assert json.loads(cfg.read_text())["process"]["rlimits"][0] == {
        "type": "RLIMIT_MEMLOCK", "hard": 8388608, "soft": 0}


def test_engine_hang_names_one_model_on_every_node(lab_dirs):
    rec = lab_dirs / "faults.json"
    [r] = faults.set_fault("engine-hang", rec, model="openai/gpt-oss-20b")
    assert r.status == "changed" and faults.current(rec) == ["engine-hang"]
    assert r.why.startswith("faults now: engine-hang (openai/gpt-oss-20b)")
    [r] = faults.set_fault("sglang-hang", rec)
    assert faults.models(rec) == ["openai/gpt-oss-20b"]  # another fault keeps the model
    for n in ("spark1", "spark2"):
        assert es.hang_models(str(faults.view_dir(n))) == {"openai/gpt-oss-20b"}
    [cleared] = faults.set_fault("none", rec)
    assert faults.models(rec) == [] and es.hang_models(str(faults.view_dir("spark1"))) == set()


@pytest.mark.parametrize("name,model", [("engine-hang", None), ("sglang-hang", "a/b")])
def test_engine_hang_and_only_it_takes_a_model(lab_dirs, name, model):
    [r] = faults.set_fault(name, lab_dirs / "faults.json", model=model)
    assert r.failed and r.why.startswith("--model: engine-hang needs the model")
    assert not (lab_dirs / "faults.json").exists()


def test_a_standin_for_the_hung_model_prints_its_init_line_and_goes_silent(lab_dirs, monkeypatch):
    faults.set_fault("engine-hang", lab_dirs / "faults.json", model="org/hung")
    monkeypatch.setattr(es, "LAB_VIEW", str(faults.view_dir("spark1")))
    said = []
    monkeypatch.setattr(es, "log", lambda msg, engine="standin": said.append((engine, msg)))

    class Silent(Exception):
        pass

    def silence():
        raise Silent

    monkeypatch.setattr(es, "_silence", silence)
    es.hang_at_init("org/other", "vllm", "10.0.0.1:29501", 2)  # another model: returns
    assert said == []
    with pytest.raises(Silent):
        es.hang_at_init("org/hung", "vllm", "10.0.0.1:29501", 2)
    assert said == [("vllm", "world_size=2 rank=0 local_rank=0 distributed_init_method="
                             "tcp://10.0.0.1:29501 backend=nccl")]
    from sparkdeploy.engines.diagnose import classify

    assert classify({"spark1": [said[0][1]]}).cls == "nccl-init-hang"
