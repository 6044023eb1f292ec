"""Lab part 2 inside ``lab.up``: the closed internet (model hub and package index on the
controller's management address) and the community images on the head.

The lab's ``env`` file gains ``HF_ENDPOINT``, ``PIP_INDEX_URL`` and ``PIP_TRUSTED_HOST``; the
profile overlay (``layout.PROFILE_OVERLAY``, extended by ``configs/lab.yaml``) names the same
endpoints (``model.endpoint``, ``images.layer.index_url``) for the /24 lab.up chose.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.lab import daemons, hub, images, layout, pkgindex
from sparkdeploy.lab.dockerd import docker, url
from sparkdeploy.lab.proc import LabError

RECIPES = Path(__file__).resolve().parent / "recipes"
"""The lab's own recipes (``lab-tiny``): named by the lab's profile overlay only."""
HUB_PORT = hub.DEFAULT_PORT
INDEX_PORT = pkgindex.DEFAULT_PORT


def hub_url(controller: str) -> str:
    return f"http://{controller}:{HUB_PORT}"


def index_url(controller: str) -> str:
    return f"http://{controller}:{INDEX_PORT}/simple/"


def profile_overlay(controller: str) -> str:
    """The profile overlay for a lab whose controller is ``controller``: the only place the lab
    profile gets its hub and index addresses from."""
    body = {"sparkdeploy": {"recipes": [str(RECIPES)],
                            "model": {"endpoint": hub_url(controller),
                                      "index_url": index_url(controller)},
                            "images": {"layer": {"index_url": index_url(controller)}}}}
    return ("# Written by lab.up for the management network it chose; do not edit.\n"
            + yaml.safe_dump(body, sort_keys=False))


def lab_images(real_engine: bool = False) -> tuple[images.ImageSpec, ...]:
    """The images lab.up builds on the head: the community images' stand-ins, and with
    ``real_engine`` the real vLLM (``images.REAL_VLLM``)."""
    return (*images.COMMUNITY_IMAGES, *((images.REAL_VLLM,) if real_engine else ()))


def prefetch(real_engine: bool = False) -> tuple[bool, str]:
    """Every wheel the lab needs, cached (index requirements and the images' wheels)."""
    try:
        report = pkgindex.ensure_wheels()
        did, why = images.prefetch_wheels(lab_images(real_engine))
    except pkgindex.WheelDownloadError as e:
        raise LabError(str(e).splitlines()[0]) from None
    did = did or report.changed
    index = (f"index sets downloaded: {len(report.downloaded)}" if report.changed
             else "index sets cached")
    return did, f"{index}; {why}"


def ensure_servers(st: dict, controller: str) -> list[Result]:
    hurl, iurl = hub_url(controller), index_url(controller)
    out = [
        daemons.ensure_daemon(st, "hub", hub.cli_argv(controller),
                                 lambda: hub.wait_ready(hurl, timeout=0.5)),
        daemons.ensure_daemon(st, "index", pkgindex.cli_argv(controller),
                                 lambda: pkgindex.wait_ready(iurl, timeout=0.5)),
    ]
    env = {"HF_ENDPOINT": hurl, **pkgindex.pip_env(iurl)}
    wrote = daemons.set_env(st, **env)
    out.append(Result("env", Status.CHANGED if wrote else Status.OK, " ".join(f"{k}={v}" for k, v in env.items())))
    return out


def ensure_community_images(head: str, real_engine: bool = False) -> list[Result]:
    return images.build_community_images(url(head), layout.BASE_IMAGE,
                                         recipes=lab_images(real_engine), node=head)


def seed_worker(head: str, worker: str, ref: str = "scitrera/dgx-spark-sglang:0.5.10rc0") -> Result:
    """Give a worker the derivative's base image (for delta-shipping tests)."""
    have = subprocess.run(docker(worker, "image", "inspect", "--format", "{{.Id}}", ref),
                          capture_output=True, text=True)
    want = subprocess.run(docker(head, "image", "inspect", "--format", "{{.Id}}", ref),
                          capture_output=True, text=True)
    if want.returncode != 0:
        raise LabError(f"{head} has no {ref} to seed {worker} with")
    if have.returncode == 0 and have.stdout == want.stdout:
        return Result("seed-worker", Status.OK, f"{ref} present", worker)
    save = subprocess.Popen(docker(head, "save", ref), stdout=subprocess.PIPE)
    load = subprocess.run(docker(worker, "load", "-q"), stdin=save.stdout, capture_output=True, text=True)
    save.stdout.close()  # type: ignore[union-attr]
    if save.wait() != 0 or load.returncode != 0:
        raise LabError(f"seeding {worker} with {ref} failed: {load.stderr.strip()}")
    return Result("seed-worker", Status.CHANGED, f"loaded {ref}", worker)
