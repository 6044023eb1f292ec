"""The ``sparkdeploy`` command: invoke's ``Program`` over the package's task namespace, so
``sparkdeploy deploy.all`` is ``inv deploy.all`` and works outside a checkout (the same
configuration: the collection's defaults, ``INVOKE_SPARKDEPLOY_*``, ``-f FILE``)."""

from __future__ import annotations

from invoke import Program

from sparkdeploy import __version__
from sparkdeploy.tasks import ns


def main() -> None:
    Program(name="sparkdeploy", binary="sparkdeploy", namespace=ns, version=__version__).run()
