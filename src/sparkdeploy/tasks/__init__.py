"""The invoke namespaces, one module per capability; this module only assembles them."""

from invoke import Collection

from sparkdeploy.deployment import DEFAULTS
from sparkdeploy.tasks import bench, cluster, deploy, hosts, image, lab, model, profile, serve, services

ns = Collection(profile, hosts, cluster, services, image, model, lab, bench, serve, deploy)
ns.configure({"sparkdeploy": dict(DEFAULTS)})
