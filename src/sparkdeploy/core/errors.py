"""The one error tree: every error sparkdeploy means to raise is an ``Error``, whose ``str()`` is
its one line and whose ``code`` is the exit status a task ends with. Anything else is a bug and
keeps its traceback.

- ``UsageError`` (exit 2): input the user can fix (a profile, a plan selection, a flag, an
  input file, a model config).
- ``RunError`` (exit 1): what went wrong while running (a node, the lock, a wait, a record, an
  output file, an answer from outside).
- ``StepFailed`` (exit 1): a step's own verdict that it cannot go on; the step's context turns
  it into the step's one failed result (for ``node``, when it names one). ``PartFailed``: one
  part of a step (one node's, one engine's) failed; in a fan-out (``StepContext.each``) the
  other parts go on.

Where each becomes an outcome: a step's context (``StepContext.run``) turns a ``StepFailed``
into one failed result; the runner (``deploy.all``) turns any ``Error`` a step lets out into
one failed result; the task driver (``tasks/_common.exits``) turns any ``Error`` into one line
and its ``code``.
"""

from __future__ import annotations


class Error(Exception):
    """An error sparkdeploy means: ``str()`` is its one line, ``code`` the exit status, ``node``
    the node it is about (None: no one node)."""

    code = 1
    node: str | None = None

    def __init__(self, *args: object, node: str | None = None):
        super().__init__(*args)
        if node is not None:
            self.node = node


class UsageError(Error):
    """Input the user can fix: exit 2."""

    code = 2


class RunError(Error):
    """What went wrong while running: exit 1."""


class StepFailed(Error):
    """A step cannot go on: its one failed result (for ``node``), raised from its body or
    anything it calls; exit 1."""


class PartFailed(StepFailed):
    """One part of a step (one node's, one engine's) failed: its failed result (for ``node``);
    in a fan-out (``StepContext.each``) the other parts go on."""

    def __init__(self, why: str, node: str | None = None):
        super().__init__(why, node=node)
