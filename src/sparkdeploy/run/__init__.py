"""Plans run as a graph of registered steps (``runner``, ``plan``), the run record of
``deploy.all``, and ``serve.swap`` (a plan on each side of a bring-up)."""
