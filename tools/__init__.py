"""Tools of the repository, not of the installed package (out of the wheel): the lab's
benchmarks (``python -m tools.perf``, ``nox -s perf``) and the flag manifest maker
(``python -m tools.flagmaker``, ``nox -s engine_flags``)."""
