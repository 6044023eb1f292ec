"""`inv serve.*`: bring the model up across the nodes, and say why when it does not come up."""

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy.tasks._flags import task


@task(iterable=["log"], help={"log": "an engine log file, one per node (repeat --log for each)"})
def diagnose(c, log=None):
    """Classify engine logs: prints `class: NAME`, then the evidence lines as FILE:LINE: text."""
    from sparkdeploy import diagnose as dx

    if not log:
        raise Exit("--log: give at least one engine log file", code=2)
    code = dx.main(list(log))
    if code:
        raise Exit(code=code)


ns = Collection("serve", diagnose)
