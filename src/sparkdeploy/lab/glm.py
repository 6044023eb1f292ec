"""The GLM deployment that ran on spark1 before the seed's work: four systemd units, lab only.

The seed had to stop `vllm-cluster.service`, `vllm-proxy.service`, `vllm-embeddings.service`
and `vllm-reranker.service` on the head before the GPU was free. The lab rebuilds that state on
its spark1 with the stand-ins (``standins/systemctl``, ``standins/nvidia-smi``): the cluster unit
holds the "GPU" (its process registers as a GPU user through ``standins/gpu_user.py``), the other
three run long sleeping processes. The proxy Requires= the cluster (stopping the cluster stops
the proxy too, as systemd does); embeddings and reranker are only ordered After= it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkdeploy.core.outcomes import Result, Status

STEP = "lab.glm"
STANDINS = Path(__file__).resolve().parent / "standins"
"""The stand-ins in this checkout (the lab copies this directory onto each node)."""

GLM_UNITS = (
    "vllm-cluster.service",
    "vllm-proxy.service",
    "vllm-embeddings.service",
    "vllm-reranker.service",
)
GPU_PROCESS_NAME = "VLLM::EngineCore"
"""What nvidia-smi's compute-apps list shows for the GLM cluster's process."""

SLEEPER = "import time; time.sleep(10**9)"


def glm_unit_files(gpu_user: str, python: str = "/usr/bin/python3") -> dict[str, str]:
    """Unit name -> unit file text. ``gpu_user``: path of gpu_user.py as the node sees it."""
    sleep = f'{python} -c "{SLEEPER}"'
    install = "\n[Install]\nWantedBy=multi-user.target\n"
    return {
        "vllm-cluster.service": (
            "[Unit]\n"
            "Description=GLM cluster\n"
            "After=network-online.target\n"
            "Wants=network-online.target\n"
            "\n[Service]\n"
            "Type=simple\n"
            'Environment="VLLM_HOST_IP=127.0.0.1" "RAY_memory_monitor_refresh_ms=0"\n'
            f"ExecStart={python} {gpu_user} {GPU_PROCESS_NAME}\n"
            "Restart=on-failure\n"
            "RestartSec=5\n" + install
        ),
        "vllm-proxy.service": (
            "[Unit]\n"
            "Description=GLM proxy\n"
            "Requires=vllm-cluster.service\n"
            "After=vllm-cluster.service vllm-embeddings.service vllm-reranker.service\n"
            "\n[Service]\n"
            "Type=simple\n"
            f"ExecStart={sleep}\n"
            "Restart=on-failure\n" + install
        ),
        "vllm-embeddings.service": (
            "[Unit]\n"
            "Description=GLM embeddings\n"
            "After=vllm-cluster.service\n"
            "\n[Service]\n"
            "Type=simple\n"
            f"ExecStart={sleep}\n"
            "Restart=on-failure\n" + install
        ),
        "vllm-reranker.service": (
            "[Unit]\n"
            "Description=GLM reranker\n"
            "After=vllm-cluster.service\n"
            "\n[Service]\n"
            "Type=simple\n"
            f"ExecStart={sleep}\n"
            "Restart=on-failure\n" + install
        ),
    }


def deploy_glm(
    unit_dir: Path,
    systemctl: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    gpu_user: str | None = None,
    python: str = "/usr/bin/python3",
    node: str | None = "spark1",
) -> Result:
    """Write the four GLM units into ``unit_dir``, enable and start them; idempotent.

    ``unit_dir``: where to write, as this process sees it (outside a node's mount namespace
    that is the node's backing directory, never the machine's own /etc/systemd/system).
    ``systemctl``: argv prefix that runs the stand-in systemctl on the node, e.g.
    ``["nsenter", "--mount=F", "--net=N", "/opt/sparkdeploy-lab/bin/systemctl"]``.
    ``env``: added to this process's environment for those commands.
    ``gpu_user``: gpu_user.py's path as the node sees it (default: this checkout's copy).
    A unit whose file changed is restarted when it was running; a second call changes nothing.
    """
    run_env = {**os.environ, **(env or {})}
    done: list[str] = []

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*systemctl, *args], env=run_env, capture_output=True, text=True)

    def apply(verb: str, units: list[str], past: str) -> str | None:
        """Run ``systemctl VERB UNITS`` when there are units; the error line if it failed."""
        if not units:
            return None
        r = ctl(verb, *units)
        if r.returncode != 0:
            return f"systemctl {verb} failed: {r.stderr.strip()}"
        done.append(f"{past} " + ", ".join(units))
        return None

    def inactive() -> list[str]:
        return [n for n in GLM_UNITS if ctl("is-active", "--quiet", n).returncode != 0]

    files = glm_unit_files(gpu_user or str(STANDINS / "gpu_user.py"), python)
    unit_dir.mkdir(parents=True, exist_ok=True)
    rewritten = []
    for name, text in files.items():
        path = unit_dir / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            rewritten.append(name)
    restart: list[str] = []
    if rewritten:
        ctl("daemon-reload")
        done.append("wrote " + ", ".join(rewritten))
        restart = [n for n in rewritten if n not in inactive()]
    error = apply("restart", restart, "restarted")
    if not error:
        disabled = [n for n in GLM_UNITS if ctl("is-enabled", "--quiet", n).returncode != 0]
        error = apply("enable", disabled, "enabled") or apply("start", inactive(), "started")
    if error:
        return Result(STEP, Status.FAILED, error, node)
    if inactive():
        return Result(STEP, Status.FAILED, "not active after start: " + ", ".join(inactive()), node)
    if done:
        return Result(STEP, Status.CHANGED, "; ".join(done), node, {"units": list(GLM_UNITS)})
    return Result(STEP, Status.OK, "GLM units already enabled and running", node, {"units": list(GLM_UNITS)})
