"""The ``sparkdeploy`` command: invoke's ``Program`` over the package's task namespace, so
``sparkdeploy deploy.all`` is ``inv deploy.all`` and works outside a checkout (the same
configuration: the collection's defaults, ``INVOKE_SPARKDEPLOY_*``, ``-f FILE``).

A usage error of the command line (a missing required argument, a flag given twice, an unknown
flag: invoke's ``ParseError``) exits 2 with invoke's one line, as every other usage error does;
``inv`` itself (invoke's own program) exits 1 for those."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from invoke import Program
from invoke.exceptions import Exit, ParseError

from sparkdeploy import __version__
from sparkdeploy.tasks import ns


class _Program(Program):
    """invoke's program, its parse errors a usage exit (2)."""

    def parse_core(self, argv: Any) -> None:
        with _usage():
            super().parse_core(argv)

    def parse_tasks(self) -> None:
        with _usage():
            super().parse_tasks()

    def parse_cleanup(self) -> None:
        with _usage():
            super().parse_cleanup()


@contextmanager
def _usage() -> Iterator[None]:
    try:
        yield
    except ParseError as e:
        raise Exit(str(e), code=2) from None


def main() -> None:
    _Program(name="sparkdeploy", binary="sparkdeploy", namespace=ns, version=__version__).run()
