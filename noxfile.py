"""Sessions only; logic lives in src/sparkdeploy. `nox --list` shows each session's docstring."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and lab tests (lab tests need root and Linux; pass pytest args after --)."""
    session.install("-e", ".[dev]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check on the package, tasks, tests and scripts."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", "src", "tests", "scripts", "tasks.py", "noxfile.py")
