"""A scripted node for the model steps: the commands sparkdeploy sends run for real on this
machine (the node helper, mkdir, df, stat), except docker, which is answered from a table of
images; ``docker run ... IMAGE python3 model_node.py fetch`` runs the helper with this
interpreter (it has huggingface_hub, as the images do) and the stdin the step gave it."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from invoke import Result

from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Feed
from sparkdeploy.profile.config import load_profile
from tests.unit.fakes import FakeContext
from tests.unit.fakes import deployment as fake_deployment
from tests.unit.profiles import lab_profile_with_overlay


@dataclass
class Node:
    images: dict[str, bool] = field(default_factory=dict)  # ref -> carries huggingface_hub
    free: int | None = None  # what df says is free (None: the real df)


class NodesCtx(FakeContext):
    def __init__(self, nodes: dict[str, Node], dry: bool = False):
        super().__init__(dry)
        self._set("nodes", nodes)

    def call(self, alias, argv, stdin):
        return alias, argv, stdin  # (node, argv, stdin text or None)

    def answer(self, alias, argv, text, command, kw):
        node = self.nodes[alias]
        if argv[:2] == ["sh", "-c"] and "sha256sum -c" in argv[2] and 'exec "$@"' in argv[2]:
            checked = subprocess.run(argv[:4] + ["true"], capture_output=True, text=True)
            if checked.returncode != 0:  # a staged file changed: not run, as on a node
                return Result(stdout="", stderr=checked.stderr, exited=checked.returncode,
                              command=command)
            argv = argv[4:]
        if argv[0] == "docker":
            return self._docker(node, argv[3:], text, kw, command)
        if argv[0] == "python3":
            argv = [sys.executable, *argv[1:]]
        if argv[0] == "sh" and "df -P" in argv[2] and node.free is not None:
            out = ("Filesystem 1-blocks Used Available Capacity Mounted on\n"
                   f"/dev/fake 100000000000 1 {node.free} 1% /srv\n")
            return Result(stdout=out, stderr="", exited=0, command=command)
        return self._local(argv, text, kw, command)

    def _local(self, argv, text, kw, command):
        # what runs here for real is the helper, mkdir, df, stat: never a docker this machine
        # may have (a lab's dockerd), should an argv the table does not know slip through
        if any(Path(a).name in ("docker", "dockerd", "ssh") for a in argv[:3]):
            raise AssertionError(f"the fake node does not run {argv[:3]} on this machine")
        if isinstance(kw.get("in_stream"), Feed):  # stdin open until the command ends
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            p.stdin.write(text or "")
            p.stdin.flush()
            err: list[str] = []
            reader = threading.Thread(target=lambda: err.append(p.stderr.read()))
            reader.start()
            out = p.stdout.read()
            p.wait()
            reader.join()
            p.stdin.close()
            cp = subprocess.CompletedProcess(argv, p.returncode, out, err[0])
        else:
            cp = subprocess.run(argv, input=text, capture_output=True, text=True)
        for stream, said in (("out_stream", cp.stdout), ("err_stream", cp.stderr)):
            if kw.get(stream) is not None:  # as it streams in: the helper's progress and words
                kw[stream].write(said)
        return Result(stdout=cp.stdout, stderr=cp.stderr, exited=cp.returncode, command=command)

    def _docker(self, node, argv, text, kw, command):
        if argv[:2] == ["image", "inspect"]:
            ref = argv[-1]
            if ref in node.images:
                return Result(stdout='{"Id": "sha256:x"}', stderr="", exited=0, command=command)
            return Result(stdout="", stderr=f"Error: No such image: {ref}", exited=1, command=command)
        if argv[0] == "run":
            ref = argv[argv.index("--") + 1]
            rest = argv[argv.index("--") + 2:]
            if rest[:1] == ["-c"]:
                if node.images.get(ref):
                    return Result(stdout="0.36.2\n", stderr="", exited=0, command=command)
                return Result(stdout="", stderr="ModuleNotFoundError: No module named "
                              "'huggingface_hub'", exited=1, command=command)
            return self._local([sys.executable, *rest], text, kw, command)
        raise AssertionError(f"unexpected docker command {argv}")


def deployment(tmp_path: Path, nodes: dict[str, Node], endpoint: str, dry: bool = False,
               **model) -> tuple[Deployment, NodesCtx]:
    lab = lab_profile_with_overlay(tmp_path / "profile")  # not the machine's lab
    prof = load_profile(lab)
    m = prof.model.model_copy(update={"path": str(tmp_path / "models" / "m"), "endpoint": endpoint,
                                      "disk_margin_mb": 1, **model})
    prof = prof.model_copy(update={"model": m})
    ctx = NodesCtx(nodes, dry=dry)
    return fake_deployment(lab, tmp_path / "state", ctx, dry=dry, profile=prof), ctx
