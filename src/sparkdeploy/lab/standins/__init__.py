"""Stand-ins for what a DGX Spark has and this machine lacks (lab only).

Executables (files without a suffix) go to ``/opt/sparkdeploy-lab/bin`` on each node (first on
the node's PATH, and on its dockerd's PATH for the NVIDIA runtime hook); the standard-library
modules next to them go to ``/opt/sparkdeploy-lab/lib``. ``install`` (called by ``lab.up`` for
each node) also gives the node its RoCE devices, its default route and its fault view: see
``nodeinstall.py`` and docs/lab-standins.md.
"""


def install(root, node):
    """Put the stand-ins on ``node`` (backing dir ``root``); return what changed."""
    from sparkdeploy.lab.standins import nodeinstall  # noqa: PLC0415

    return nodeinstall.install(root, node)
