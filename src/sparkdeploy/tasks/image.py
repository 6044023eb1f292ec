"""`inv image.*`: probe the candidate images, build the transformers layer, ship node to node."""

import sys

from invoke import Collection

from sparkdeploy import checks
from sparkdeploy.steps import images
from sparkdeploy.steps import ship as ship_step
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


def _probe_table(record):
    if not record:
        return
    cols = ("image", "engine", "engine ver", "transformers", "files", "config", "platform", "verdict")
    rows = []
    for r in record["candidates"]:
        rows.append((r["image"], r["engine"], r.get("engine_version") or "-",
                     r.get("transformers") or "-", images._yn(r.get("files_ok")),
                     images._yn(r.get("config_ok")),
                     r.get("platform", "-") + ("" if r.get("platform_ok", True) else " (!)"),
                     r["verdict"]))
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        t = Table(title="image candidates")
        for c in cols:
            t.add_column(c)
        for row in rows:
            t.add_row(*row)
        Console().print(t)
    else:
        print("\t".join(cols))
        for row in rows:
            print("\t".join(row))


@task(default=True, help={"profile": "profile file"})
def probe(c, profile=None):
    """Probe every candidate image on the head, decide, and write the decision record."""

    def step(dep):
        results, record = images.probe(dep)
        _probe_table(record)
        return results

    run_step(c, step, profile=profile, lock=False, title="image.probe")


@task(help={"profile": "profile file"})
def build(c, profile=None):
    """Build the transformers layer on the head (ok without building when already built)."""
    run_step(c, images.build, print, profile=profile, title="image.build")


@task(help={"to": "peer node(s): NAME[,NAME...] or all", "image": "image (default: the chosen one)",
            "profile": "profile file"})
def ship(c, to="all", image=None, profile=None):
    """Copy an image node to node over the fast link, sending only the layers a peer lacks."""
    last = {}

    def progress(peer, done, total):
        pct = int(100 * done / total) if total else 0
        if last.get(peer, -10) + 10 <= pct or not total:
            last[peer] = pct
            print(f"[{peer}] {done / 1e6:,.0f} MB read of ~{total / 1e6:,.0f} MB ({pct}%)", flush=True)

    image = flags.parsed("--image", image, checks.image_ref) if image else None
    run_step(c, ship_step.ship, to, image, progress, profile=profile, nodes=("--to", to),
             title="image.ship")


ns = Collection("image", probe, build, ship)
