"""The rehearsal lab: simulated Spark nodes on one Linux machine (root only).

A node is a persistent network namespace (``lab-spark1``) plus a persistent mount namespace
(a bind-mounted nsfs file under ``/var/lib/sparkdeploy/lab/ns/``) with private bind mounts
over the paths a deployment writes. Each node runs a real OpenSSH ``sshd`` and a real
``dockerd``. A management bridge joins the controller (the root namespace) and every node;
a fast link (veth pair, or a bridge for three or more nodes) joins the nodes.

Entry points: ``lifecycle.up``, ``lifecycle.down``, ``lifecycle.status``; each returns a list
of ``sparkdeploy.core.outcomes.Result`` and never prints. State is machine-wide
(``/var/lib/sparkdeploy/lab/state.json``), so a lab left by another checkout is found and
reused or taken down.
"""
