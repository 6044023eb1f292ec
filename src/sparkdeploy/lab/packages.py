"""The Debian packages the lab needs on the controller machine; install only what is missing."""

from __future__ import annotations

import os

from sparkdeploy.lab.proc import LabError, run

REQUIRED = ["iproute2", "util-linux", "mount", "openssh-server", "openssh-client", "docker.io",
            "containerd", "runc", "debootstrap", "tar", "debian-archive-keyring", "rsync",
            "iputils-ping"]


def missing(pkgs: list[str] = REQUIRED) -> list[str]:
    cp = run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n", *pkgs], check=False)
    have = {ln.split()[0] for ln in cp.stdout.splitlines() if ln.endswith(" installed")}
    return [p for p in pkgs if p not in have]


def ensure(pkgs: list[str] = REQUIRED) -> list[str]:
    """apt-get install -y the missing ones (update the lists once if needed); return them."""
    todo = missing(pkgs)
    if not todo:
        return []
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "install", "-y", "--no-install-recommends", *todo]
    cp = run(argv, check=False, env=env, timeout=1200)
    if cp.returncode != 0:
        run(["apt-get", "update"], env=env, timeout=600)
        run(argv, env=env, timeout=1200)
    still = missing(todo)
    if still:
        raise LabError(f"apt-get install left missing: {' '.join(still)}")
    return todo
