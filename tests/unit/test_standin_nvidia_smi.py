"""The lab's nvidia-smi stand-in: GB10 answers, and GPU users that come and go with units."""


from tests.unit.standin_node import (
    StandinNode,
    node_fixture,  # noqa: F401
    wait_for,
)

APPS = ["--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"]


def test_query_gpu_answers_gb10_with_na_memory(node):
    r = node.nvidia_smi("--query-gpu=name,memory.total,memory.used,memory.free,index",
                        "--format=csv")
    assert r.returncode == 0
    assert r.stdout == ("name, memory.total [MiB], memory.used [MiB], memory.free [MiB], index\n"
                        "NVIDIA GB10, [N/A], [N/A], [N/A], 0\n")
    r = node.nvidia_smi("--query-gpu=name", "--format=csv,noheader")
    assert (r.stdout, r.returncode) == ("NVIDIA GB10\n", 0)
    r = node.nvidia_smi("--query-gpu=memory.total,driver_version", "--format=csv,nounits")
    assert r.stdout == "memory.total, driver_version\n[N/A], 580.95.05\n"


def test_uuid_is_stable_per_node_and_matches_list(node, tmp_path):
    uuid = node.nvidia_smi("--query-gpu=uuid", "--format=csv,noheader").stdout.strip()
    assert uuid.startswith("GPU-")
    r = node.nvidia_smi("-L")
    assert (r.stdout, r.returncode) == (f"GPU 0: NVIDIA GB10 (UUID: {uuid})\n", 0)
    assert node.nvidia_smi("--query-gpu=uuid", "--format=csv,noheader").stdout.strip() == uuid
    other = StandinNode(tmp_path / "other")
    assert other.nvidia_smi("--query-gpu=uuid", "--format=csv,noheader").stdout.strip() != uuid


def test_plain_table_names_gb10_and_unsupported_memory(node):
    r = node.nvidia_smi()
    assert r.returncode == 0
    assert "NVIDIA GB10" in r.stdout
    assert "Not Supported" in r.stdout
    assert "Driver Version: 580.95.05" in r.stdout
    assert "No running processes found" in r.stdout
    table = r.stdout.splitlines()[1:]
    assert {len(line) for line in table if line} == {91}


def test_errors_like_the_real_tool(node):
    r = node.nvidia_smi("--bogus")
    assert r.returncode == 2 and "--bogus" in r.stderr and r.stdout == ""
    r = node.nvidia_smi("--query-gpu=name,bogus", "--format=csv")
    assert r.returncode == 2
    assert r.stderr.startswith('Field "bogus" is not a valid field to query.')
    r = node.nvidia_smi("--query-gpu=name")
    assert r.returncode == 2
    r = node.nvidia_smi("--query-gpu=name", "--format=xml")
    assert r.returncode == 2
    r = node.nvidia_smi("-i", "1", "--query-gpu=name", "--format=csv")
    assert (r.stdout, r.returncode) == ("No devices were found\n", 6)


def test_compute_apps_empty_then_header_only(node):
    assert node.nvidia_smi(*APPS).stdout == ""
    r = node.nvidia_smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv")
    assert r.stdout == "pid, process_name, used_gpu_memory [MiB]\n"


def test_registered_process_listed_while_alive(node):
    proc = node.gpu_user("VLLM::EngineCore")
    rows = wait_for(node.gpu_apps, "the helper registers")
    assert rows == [[str(proc.pid), "VLLM::EngineCore", "[N/A]"]]
    table = node.nvidia_smi().stdout
    assert f"{proc.pid}      C   VLLM::EngineCore" in table
    proc.kill()  # no chance to unregister: still not listed, its PID is dead
    proc.wait()
    assert node.gpu_apps() == []


def test_gpu_unit_holds_the_gpu_until_stopped(node):
    from sparkdeploy.lab.glm import STANDINS

    node.unit("gpu.service", "[Unit]\nDescription=GPU holder\n[Service]\n"
              f"ExecStart=/usr/bin/env python3 {STANDINS / 'gpu_user.py'} ray::Worker\n")
    assert node.systemctl("start", "gpu.service").returncode == 0
    rows = wait_for(node.gpu_apps, "the unit's process registers")
    assert rows == [[str(node.main_pid("gpu.service")), "ray::Worker", "[N/A]"]]
    assert node.systemctl("stop", "gpu.service").returncode == 0
    assert node.gpu_apps() == []
    assert list((node.root / "gpu-users").iterdir()) == []  # SIGTERM: it unregistered
