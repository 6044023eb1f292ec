"""The lab's benchmarks: speed and accuracy figures of the deployment's steps, measured on the lab.

``python -m tools.perf [NAME ...]`` (``nox -s perf -- NAME``) runs them; the registry of
names is in ``__main__``. They drive the lab (and may import it); the product never imports
them. The figures they measured are in docs/notes/."""
