"""`inv link.*`: the link doctor."""

from invoke import Collection

from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"profile": "profile file (default: sparkdeploy.profile)"})
def check(c, profile=None):
    """Check the fast link: interfaces, MTU, subnet, RoCE HCAs, engines' addresses, reach, bandwidth."""
    run_step(c, "link.check", profile=profile, lock=False)


ns = Collection("link", check)
