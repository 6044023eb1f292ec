"""The GLM deployment of spark1 as unit files, run by the stand-ins in a tmp dir."""


from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab.glm import GLM_UNITS, GPU_PROCESS_NAME, STANDINS, deploy_glm
from tests.unit.standin_node import (
    node_fixture,  # noqa: F401
    wait_for,
)

SYSTEMCTL = [str(STANDINS / "systemctl")]
# the head's stop order in the seed's profile, as the services step runs it
STOP_ORDER = ["vllm-proxy.service", "vllm-embeddings.service", "vllm-reranker.service",
              "vllm-cluster.service"]


def deploy(node):
    env = {k: node.env[k] for k in ("SPARKDEPLOY_STANDIN_ROOT", "SPARKDEPLOY_UNIT_DIR")}
    return deploy_glm(node.unit_dir, SYSTEMCTL, env)


def test_deploy_writes_enables_and_starts_the_four_units(node):
    result = deploy(node)
    assert result.status is Status.CHANGED, result.why
    assert sorted(p.name for p in node.unit_dir.glob("*.service")) == sorted(GLM_UNITS)
    r = node.systemctl("is-active", *GLM_UNITS)
    assert (r.stdout, r.returncode) == ("active\n" * 4, 0)
    r = node.systemctl("is-enabled", *GLM_UNITS)
    assert r.stdout == "enabled\n" * 4
    r = node.systemctl("list-units", "--all", "--plain", "--no-legend", "--no-pager",
                       "--type=service", "--", *STOP_ORDER)
    assert r.stdout.splitlines() == [
        "vllm-cluster.service    loaded active running GLM cluster",
        "vllm-embeddings.service loaded active running GLM embeddings",
        "vllm-proxy.service      loaded active running GLM proxy",
        "vllm-reranker.service   loaded active running GLM reranker",
    ]
    rows = wait_for(node.gpu_apps, "the cluster holds the GPU")
    assert rows == [[str(node.main_pid("vllm-cluster.service")), GPU_PROCESS_NAME, "[N/A]"]]


def test_deploy_twice_changes_nothing(node):
    assert deploy(node).status is Status.CHANGED
    pids = {u: node.main_pid(u) for u in GLM_UNITS}
    again = deploy(node)
    assert (again.status, again.why) == (Status.OK, "GLM units already enabled and running")
    assert {u: node.main_pid(u) for u in GLM_UNITS} == pids


def test_deploy_brings_back_a_stopped_unit(node):
    deploy(node)
    node.systemctl("stop", "vllm-reranker.service")
    result = deploy(node)
    assert (result.status, result.why) == (Status.CHANGED, "started vllm-reranker.service")


def test_services_step_sequence_frees_the_gpu_and_restores(node):
    deploy(node)
    wait_for(node.gpu_apps, "GPU busy")
    for unit in STOP_ORDER:
        assert node.systemctl("stop", unit).returncode == 0
    assert node.gpu_apps() == []
    r = node.systemctl("is-active", *GLM_UNITS)
    assert (r.stdout, r.returncode) == ("inactive\n" * 4, 3)
    for unit in reversed(STOP_ORDER):
        assert node.systemctl("start", unit).returncode == 0
    assert node.systemctl("is-active", *GLM_UNITS).returncode == 0
    wait_for(node.gpu_apps, "GPU busy again")


def test_stopping_the_cluster_stops_the_proxy_only(node):
    deploy(node)
    node.systemctl("stop", "vllm-cluster.service")
    r = node.systemctl("is-active", *STOP_ORDER)
    assert r.stdout == "inactive\nactive\nactive\ninactive\n"
