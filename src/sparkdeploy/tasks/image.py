"""`inv image.*`: probe the candidate images, build the derivative image, ship node to node."""

from invoke import Collection

from sparkdeploy.core import checks
from sparkdeploy.ops.image import decision
from sparkdeploy.steps import images
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import run_step, table
from sparkdeploy.tasks._flags import task


def _probe_table(dep, results) -> None:
    """The candidates from the record this run wrote (none in a dry run or when it stopped
    before deciding)."""
    decided = any("chosen" in r.details for r in results) and not dep.dry
    record = decision(dep) if decided else None
    if record:
        table("image candidates", images.PROBE_COLUMNS, images.probe_rows(record.model_dump()))


@task(default=True, help={"profile": "profile file"})
def probe(c, profile=None):
    """Probe every candidate image on the head, decide, and write the decision record."""
    run_step(c, "image.probe", profile=profile, lock=False, show=_probe_table)


@task(help={"no-cache": "build again from the base, without docker's layer cache",
            "profile": "profile file"})
def build(c, no_cache=False, profile=None):
    """Build the derivative image on the head (ok without building when already built)."""
    run_step(c, "image.build", profile=profile, no_cache=no_cache)


@task(help={"to": "peer node(s): NAME[,NAME...] or all (default: all)", "nodes": "the same as --to",
            "image": "image (default: the chosen one)", "profile": "profile file"})
def ship(c, to=None, image=None, profile=None, nodes=None):
    """Copy an image node to node over the fast link, sending only the layers a peer lacks."""
    image = flags.parsed("--image", image, checks.image_ref) if image else None
    flag, picked = flags.nodes(nodes, to=to)
    run_step(c, "image.ship", to=picked or "all", flag=flag, image=image, profile=profile)


ns = Collection("image", probe, build, ship)
