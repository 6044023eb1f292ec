import json
import shlex

import pytest

from sparkdeploy.core.events import Echo, Progress, describe
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.state import StateDir
from sparkdeploy.steps import services
from tests.unit.fakes import FakeNode, ScriptedContext, scripted
from tests.unit.profiles import SEED

GLM = ["vllm-proxy.service", "vllm-embeddings.service", "vllm-reranker.service",
       "vllm-cluster.service"]


def glm_node(**kw) -> FakeNode:
    node = FakeNode(units={u: "active" for u in GLM},
                    gpu=[(4242, "python3")], holds_gpu={"vllm-cluster.service": (4242, "python3")})
    for k, v in kw.items():
        setattr(node, k, v)
    return node




def remote(ctx, alias="spark1"):
    return [shlex.join(argv) for a, argv in ctx.calls if a == alias]


LIST = ("systemctl list-units --all --plain --no-legend --no-pager --type=service -- "
        + " ".join(GLM))
GPU = "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader"
RECORD = "/var/lib/sparkdeploy-node/services/qwen3.5-122b-a10b-fp8.json"
CAT = f"cat -- {RECORD}"
WRITE = ("sudo -n -- sh -c 'umask 022 && mkdir -p -- \"$(dirname -- \"$1\")\" && cat > \"$1.part\" "
         f"&& mv -f -- \"$1.part\" \"$1\"' sh {RECORD}")


def stopped(node) -> list[str] | None:
    """The units the node's own record says services.stop stopped (None: no record)."""
    text = node.node_files.get(RECORD)
    return json.loads(text)["units"] if text is not None else None


def test_stop_exact_commands_in_profile_order(tmp_path):
    dep, ctx, _ = scripted(tmp_path, {"spark1": glm_node()})
    results = services.stop(dep)
    assert remote(ctx) == [LIST, CAT, WRITE] + [f"sudo -n -- systemctl stop {u}" for u in GLM] + [GPU]
    assert [(r.step, r.status) for r in results] == [
        ("services.stop", Status.CHANGED), ("services.gpu-free", Status.OK)]
    # the whole local command line: OpenSSH, batch mode, host key checking, multiplexing
    first = shlex.split(ctx.commands[0])
    assert first[:9] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                         "-o", "ConnectTimeout=10", "-o", "ControlMaster=auto"]
    assert first[-3:] == ["--", "spark1", LIST]


def test_privilege_none_runs_without_sudo(tmp_path):
    text = SEED.read_text().replace("privilege: sudo", "privilege: none")
    prof = tmp_path / "p.yaml"
    prof.write_text(text)
    dep, ctx, _ = scripted(tmp_path, {"spark1": glm_node()}, profile=prof)
    services.stop(dep)
    assert f"systemctl stop {GLM[0]}" in remote(ctx)


def test_gpu_busy_then_free_waits(tmp_path):
    dep, ctx, clock = scripted(tmp_path, {"spark1": glm_node(gpu_lingers=3)})
    with dep.events.collect() as events:
        results = services.stop(dep)
    assert results[-1].status is Status.OK
    assert remote(ctx).count(GPU) == 4
    assert clock.sleeps == [2, 2, 2]
    # the wait shows progress: seconds waited of the timeout, and who is on the GPU
    assert [(e.step, e.node, e.done, e.total, e.unit, e.note) for e in events
            if isinstance(e, Progress)] == [
        ("services.gpu-free", "spark1", t, 120, "s", "on the GPU: pid 4242 (python3)")
        for t in (0, 2, 4)]
    # and each result is on the stream once, in order, the stop before the wait's
    assert [e for e in events if isinstance(e, Result)] == results


def test_gpu_timeout_names_the_processes(tmp_path):
    dep, ctx, clock = scripted(tmp_path, {"spark1": glm_node(gpu_lingers=10**6)})
    results = services.stop(dep)
    assert results[-1].status is Status.FAILED
    assert results[-1].why == "GPU still busy after 120s: pid 4242 (python3)"
    assert clock.now >= 120


def test_missing_and_inactive_units_are_ok(tmp_path):
    node = FakeNode(units={"vllm-cluster.service": "inactive"})
    dep, ctx, _ = scripted(tmp_path, {"spark1": node})
    results = services.stop(dep)
    assert remote(ctx) == [LIST, CAT, GPU]
    assert results[0].status is Status.OK
    assert "3 absent" in results[0].why
    assert stopped(node) is None and not (tmp_path / "state/services").exists()


def test_stop_records_then_restore_starts_in_reverse_and_forgets(tmp_path):
    node = glm_node()
    dep, ctx, _ = scripted(tmp_path, {"spark1": node, "spark2": FakeNode()})
    services.stop(dep)
    # the record is the node's own (written by root through stdin), not the controller's
    [write] = [argv for a, argv in ctx.calls if "$1.part" in " ".join(argv)]
    assert write[:3] == ["sudo", "-n", "--"] and write[-2:] == ["sh", RECORD]
    assert json.loads(node.node_files[RECORD]) == {
        "deployment": "qwen3.5-122b-a10b-fp8", "units": GLM, "time": "2026-11-30T00:53:20Z"}
    assert not (tmp_path / "state/services").exists()
    ctx.calls.clear()
    results = services.restore(dep)
    assert remote(ctx) == [CAT, LIST] + [f"sudo -n -- systemctl start {u}" for u in reversed(GLM)] + [
        LIST, f"sudo -n -- rm -f -- {RECORD}"]
    assert results[0].status is Status.CHANGED
    assert all(node.units[u] == "active" for u in GLM)
    assert stopped(node) is None
    assert [r.why for r in services.restore(dep)] == ["nothing recorded to restore"] * 2


def test_stop_twice_keeps_the_record_then_restore(tmp_path):
    node = glm_node()
    dep, ctx, _ = scripted(tmp_path, {"spark1": node, "spark2": FakeNode()})
    services.stop(dep)
    second = services.stop(dep)
    assert second[0].status is Status.OK
    assert stopped(node) == GLM
    services.restore(dep)
    assert all(node.units[u] == "active" for u in GLM)


def test_restore_after_partial_stop(tmp_path):
    node = glm_node(fail_stop={"vllm-reranker.service"})
    dep, ctx, _ = scripted(tmp_path, {"spark1": node, "spark2": FakeNode()})
    results = services.stop(dep)
    assert results[0].status is Status.FAILED
    assert results[0].why == "systemctl stop vllm-reranker.service: Job for vllm-reranker.service failed."
    # every unit that was active is recorded before anything stopped
    assert stopped(node) == GLM
    ctx.calls.clear()
    services.restore(dep)
    # the two that did stop come back; the two still running are not started again
    assert remote(ctx)[2:4] == ["sudo -n -- systemctl start vllm-embeddings.service",
                                "sudo -n -- systemctl start vllm-proxy.service"]
    assert all(node.units[u] == "active" for u in GLM)


def test_restore_failure_keeps_the_record(tmp_path):
    node = glm_node()
    dep, ctx, _ = scripted(tmp_path, {"spark1": node, "spark2": FakeNode()})
    services.stop(dep)
    node.fail_start = {"vllm-cluster.service"}
    results = services.restore(dep)
    assert results[0].status is Status.FAILED
    assert "vllm-cluster.service" in results[0].why
    assert stopped(node) == ["vllm-cluster.service"]


def test_dry_run_lists_and_changes_nothing(tmp_path, capsys):
    node = glm_node()
    dep, ctx, _ = scripted(tmp_path, {"spark1": node}, dry=True)
    with dep.events.collect() as events:
        results = services.stop(dep)
    # only read-only probes ran (who holds the busy GPU: no engine container of ours)
    [ps] = remote(ctx)[3:]
    assert remote(ctx)[:3] == [LIST, CAT, GPU] and ps.startswith(PS)
    out = [describe(e) for e in events if isinstance(e, Echo)]
    assert out[:-1] == [f"[spark1] $ {LIST}", f"[spark1] $ {CAT}"] + [
        f"[spark1] would run: sudo -n systemctl stop {u}" for u in GLM] + [f"[spark1] $ {GPU}"]
    assert out[-1].startswith(f"[spark1] $ {PS}")
    assert all(node.units[u] == "active" for u in GLM)
    assert not (tmp_path / "state").exists()
    assert [r.status for r in results] == [Status.SKIPPED, Status.SKIPPED]


def test_dry_run_unreachable_node_still_lists(tmp_path, capsys):
    dep, ctx, _ = scripted(tmp_path, {"spark1": glm_node(unreachable=True)}, dry=True)
    with dep.events.collect() as events:
        results = services.stop(dep)
    out = "\n".join(describe(e) for e in events if isinstance(e, Echo))
    for u in GLM:
        assert f"would run: sudo -n systemctl stop {u}" in out
    assert GPU in out
    assert results[0].why.startswith("unreachable: ssh: connect to host")
    # the unreachable node is asked once (and checked once), not once per command
    assert [argv for _, argv in ctx.calls] == [shlex.split(LIST), ["true"]]


def test_unreachable_node_fails_without_dry(tmp_path):
    dep, _, _ = scripted(tmp_path, {"spark1": glm_node(unreachable=True)})
    results = services.stop(dep)
    assert results[0].status is Status.FAILED
    assert results[0].why.startswith("unreachable:")


def test_sudo_password_prompt_is_a_clear_error(tmp_path):
    from sparkdeploy.node.hosts import HostError

    dep, _, _ = scripted(tmp_path, {"spark1": glm_node(sudo_password=True)})
    with pytest.raises(HostError, match="sudo needs a password"):
        services.stop(dep)


def test_status_reports_units_and_gpu(tmp_path):
    dep, _, _ = scripted(tmp_path, {"spark1": glm_node(), "spark2": FakeNode()})
    res = services.status(dep)
    assert res[0].why == ("vllm-proxy.service active, vllm-embeddings.service active, "
                          "vllm-reranker.service active, vllm-cluster.service active; "
                          "GPU: pid 4242 (python3)")
    assert res[1].why == "GPU free"


def test_journal_redacts_secrets(tmp_path):
    state = StateDir(tmp_path)
    state.journal({"argv": ["env", "HF_TOKEN=hf_abcdefghijklmnop", "x"], "stderr": "hf_zzzzzzzzzzzz"})
    line = (tmp_path / "journal.jsonl").read_text()
    assert "hf_abc" not in line and "hf_zzz" not in line
    assert json.loads(line)["argv"] == ["env", "HF_TOKEN=***", "x"]


def test_lock_excludes_a_second_run(tmp_path):
    from sparkdeploy.core.state import LockHeld

    state = StateDir(tmp_path)
    with state.lock("first"):
        with pytest.raises(LockHeld, match="held by pid"):
            with StateDir(tmp_path).lock("second"):
                pass
    with state.lock("again"):
        pass


def test_an_unreachable_node_is_one_failed_line_and_the_others_go_on(tmp_path):
    dep, ctx, _ = scripted(tmp_path, {"spark1": glm_node(unreachable=True), "spark2": FakeNode()})
    results = services.status(dep)
    assert [(r.node, r.status, r.why) for r in results] == [
        ("spark1", Status.FAILED, "unreachable: ssh: connect to host spark1 port 22: No route to host"),
        ("spark2", Status.OK, "GPU free")]
    # spark1 was asked once and checked once, then never again
    assert [argv[0] for a, argv in ctx.calls if a == "spark1"] == ["cat", "true"]


@pytest.mark.parametrize("task,argv", [("status", []), ("stop", ["--node", "spark1"])])
def test_the_task_renders_the_stream_and_exits_1_on_an_unreachable_node(tmp_path, capsys, task,
                                                                         argv):
    from invoke.exceptions import Exit

    from sparkdeploy.tasks import services as tasks

    ctx = ScriptedContext({"spark1": glm_node(unreachable=True), "spark2": FakeNode()})
    ctx.config["sparkdeploy"] = {"profile": str(SEED), "state_dir": str(tmp_path / "state")}
    with pytest.raises(Exit) as e:
        getattr(tasks, task)(ctx, node="spark1" if argv else None)
    assert e.value.code == 1
    out, recap = capsys.readouterr().out.split("recap:\n")
    out = out.splitlines()
    # plain lines (not a terminal), timestamped; the failure is one line; then the recap
    assert all(line[:2].isdigit() and line[2] == ":" for line in out)
    assert "  spark1   ok=0   changed=0   skipped=0   failed=1" in recap.splitlines()
    [line] = [ln for ln in out if "unreachable" in ln]
    assert line[9:] == (f"failed   {'services.' + task:<18} spark1   unreachable: "
                        "ssh: connect to host spark1 port 22: No route to host")


def test_an_unknown_node_is_bad_input_exit_2(tmp_path):
    from invoke.exceptions import Exit

    from sparkdeploy.tasks import services as tasks

    ctx = ScriptedContext({"spark1": glm_node()})
    ctx.config["sparkdeploy"] = {"profile": str(SEED), "state_dir": str(tmp_path / "state")}
    with pytest.raises(Exit, match="no node named 'spark9'") as e:
        tasks.status(ctx, node="spark9")
    assert e.value.code == 2


def engine_container(name, deployment, pids, engine="sglang"):
    from tests.unit.fakes import EngineContainer

    return EngineContainer(name, {"org.sparkdeploy.deployment": deployment,
                                  "org.sparkdeploy.engine": engine, "org.sparkdeploy.role": "head",
                                  "org.sparkdeploy.started": "2026-12-04T05:00:00Z"}, pids)


PS = ("docker -H unix:///var/run/docker.sock ps --all --no-trunc --filter "
      "label=org.sparkdeploy.deployment --filter label=org.sparkdeploy.engine --format ")


def test_gpu_held_by_this_deployments_engine_is_said_at_once(tmp_path):
    """No wait for a GPU our own engine holds: it is named, with its deployment (ok: serve.up
    keeps or replaces it)."""
    node = FakeNode(gpu=[(17112, "python3")], gpu_lingers=10**6, containers=[
        engine_container("sparkdeploy-sglang-head", "qwen3.5-122b-a10b-fp8", [17100, 17112])])
    node._gone = (17112, "python3")
    dep, ctx, clock = scripted(tmp_path, {"spark1": node})
    [res] = services.gpu_free(dep, node="spark1")
    assert (res.status, res.node) == (Status.OK, "spark1")
    assert res.why == (
        "the GPU is held by this deployment's own engine: sparkdeploy-sglang-head (deployment "
        "qwen3.5-122b-a10b-fp8, engine sglang, since 2026-12-04T05:00:00Z); serve.up keeps it if "
        "it serves what the profile says, else replaces it (serve.down frees the GPU)")
    assert clock.sleeps == []
    cmds = remote(ctx)
    assert cmds[0] == GPU and cmds[1].startswith(PS)
    assert cmds[2] == "docker -H unix:///var/run/docker.sock top sparkdeploy-sglang-head-id -eo pid"


def test_gpu_held_by_another_deployments_engine_fails_at_once(tmp_path):
    node = FakeNode(gpu=[(900, "python3")], containers=[
        engine_container("sparkdeploy-vllm-head", "other-lab", [900], engine="vllm")])
    node._gone = (900, "python3")
    node.gpu_lingers = 10**6
    dep, ctx, clock = scripted(tmp_path, {"spark1": node})
    [res] = services.gpu_free(dep, node="spark1")
    assert res.status is Status.FAILED and clock.sleeps == []
    assert res.why.startswith("the GPU is held by sparkdeploy's engine of another deployment: "
                              "sparkdeploy-vllm-head (deployment other-lab, engine vllm, since ")
    assert res.details["deployments"] == ["other-lab"]


def test_a_gpu_process_outside_our_containers_is_waited_on(tmp_path):
    node = glm_node(gpu_lingers=2, containers=[
        engine_container("sparkdeploy-sglang-head", "qwen3.5-122b-a10b-fp8", [17112])])
    dep, ctx, clock = scripted(tmp_path, {"spark1": node})
    results = services.stop(dep)
    assert results[-1].status is Status.OK and results[-1].why == "no process on the GPU"
    assert clock.sleeps == [2, 2]
    assert sum(c.startswith(PS) for c in remote(ctx)) == 1  # looked once for the same processes
