"""``python -m sparkdeploy.lab.probes``: the compatibility probes behind ``nox -s probe``.

``config --expect parse|fail``: run the ``probe_image.py`` helper with this interpreter (the nox
session's virtualenv, holding one transformers version) on the model's config, and check the
expectation: transformers 4.57 must fail on ``qwen3_5_moe``, >= 5.2 must parse it. The config is
the model's own when ``--config DIR`` is given, else the lab hub's faithful copy of its shape.

``images [--image REF] [--profile P]``: the profile's candidate images, probed through docker on
the head (``image.probe``); exits non-zero when no candidate is viable, 0 with a note when no
engine is reachable.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from invoke import Config, Context

from sparkdeploy.core.events import rendering
from sparkdeploy.core.packaged import helper
from sparkdeploy.lab.hub_repo import model_config
from sparkdeploy.node.deployment import DEFAULTS, from_context
from sparkdeploy.node.nodeops import NodeUnreachable, docker
from sparkdeploy.profile.config import ProfileError
from sparkdeploy.steps.registry import run_one


def _config_dir(given: str | None) -> str:
    if given:
        return given
    d = tempfile.mkdtemp(prefix="sparkdeploy-config-")
    Path(d, "config.json").write_text(json.dumps(model_config(), indent=2))
    return d


def config(expect: str, config_dir: str | None) -> int:
    d = _config_dir(config_dir)
    out = subprocess.run([sys.executable, str(helper("probe_image.py")), "--model-dir", d],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(f"probe failed: {out.stderr.strip()}", file=sys.stderr)
        return 1
    report = json.loads(out.stdout)
    tf = report["packages"].get("transformers")
    cfg = report["config"] or {}
    got = "parse" if cfg.get("ok") else "fail"
    line = f"transformers {tf}: {cfg.get('model_type')} -> {got}" + (
        f" ({cfg.get('error')})" if cfg.get("error") else "")
    print(line)
    if got != expect:
        print(f"expected {expect}: the compatibility facts changed", file=sys.stderr)
        return 1
    return 0


def images(image: str | None, profile: str | None) -> int:
    # invoke's config as a task sees it: the collection's defaults, then INVOKE_SPARKDEPLOY_*
    cfg = Config()
    cfg.load_collection({"sparkdeploy": dict(DEFAULTS)})
    cfg.load_shell_env()
    try:
        dep = from_context(Context(cfg), profile)
    except ProfileError as e:
        print(e, file=sys.stderr)
        return 2
    head = dep.host(dep.profile.head.name)
    try:
        r = head.run(docker(head, "info", "--format", "{{.ServerVersion}}"), change=False)
        why = None if r.ok else r.one_line_error()
    except NodeUnreachable as e:
        why = str(e)
    if why is not None:
        print(f"no Docker daemon reachable on {head.name} ({why}): image probes not run")
        return 0
    with rendering(dep.events, live=False):
        # a decision without a chosen image is a failed image.probe result
        results = run_one(dep, "image.probe", only=image)
    return 1 if any(res.failed for res in results) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparkdeploy.lab.probes")
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("config", help="does this interpreter's transformers parse the config?")
    c.add_argument("--expect", choices=["parse", "fail"], required=True)
    c.add_argument("--config", metavar="DIR", help="a directory holding the model's config.json")
    i = sub.add_parser("images", help="probe the profile's candidate images on the head")
    i.add_argument("--image", help="probe only this candidate")
    i.add_argument("--profile", help="profile file (default: $INVOKE_SPARKDEPLOY_PROFILE or the seed's)")
    args = p.parse_args(argv)
    if args.what == "config":
        return config(args.expect, args.config)
    return images(args.image, args.profile)


if __name__ == "__main__":
    raise SystemExit(main())
