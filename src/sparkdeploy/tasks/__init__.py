"""The invoke namespaces, one module per capability; this module only assembles them."""

from invoke import Collection

from sparkdeploy.node.deployment import DEFAULTS
from sparkdeploy.tasks import (
    bench,
    cluster,
    deploy,
    hosts,
    image,
    lab,
    link,
    metrics,
    model,
    profile,
    recipe,
    serve,
    services,
)

ns = Collection(profile, recipe, hosts, cluster, link, services, image, model, lab, bench, serve, metrics,
                deploy)
ns.configure({"sparkdeploy": dict(DEFAULTS)})
