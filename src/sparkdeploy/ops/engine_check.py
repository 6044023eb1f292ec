"""Every engine's command lines checked against the real engine's flags before anything stops
(``deploy.all``, as its plan is prepared): the flags of ``engines[].args`` and every flag
sparkdeploy generates for the profile's nodes (``engines.launch``), each container's, against
the flag manifest (``sparkdeploy.engines.flags``) of the engine version the last ``image.probe``
found in the engine's image. Before any probe has named it, the version is not known (an image
rule's ``min_version`` is a floor, not the version): the command lines pass when one version
with a manifest accepts them, and a refusal says so. ``serve.up``'s preflight checks the same
again against the version probed by then.
"""

from __future__ import annotations

from sparkdeploy.engines import flags as engine_flags
from sparkdeploy.engines import launch
from sparkdeploy.engines.flags import FlagError
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.ops.serve_preflight import engine_version
from sparkdeploy.profile.config import Engine


def check_engine(dep: Deployment, engine: Engine) -> str:
    """What ``engine``'s command lines were checked against (``FlagError``: one line naming
    the engine, the flag, the engine version and the closest real flag)."""
    version = engine_version(dep, engine)
    software = engine.software
    against = f"{software} {engine_flags.manifest_version(version)}" if version else None
    for c in launch(dep.profile, engine, {}, api_key=True).containers:
        args = c.engine_args
        if args is None:
            continue
        try:
            if version:
                engine_flags.check_args(software, version, list(args))
            else:
                v = engine_flags.check_args_any(
                    software, list(args),
                    f"no image.probe record names the {software} version of {engine.image}")
                against = against or f"a {software} version with a manifest ({v})"
        except FlagError as e:
            raise FlagError(f"engine {engine.name}: {e}") from None
    return f"engine {engine.name}: flags checked against {against or 'nothing: no command line'}"


def check_flags(dep: Deployment) -> list[str]:
    """Every engine of the profile, in order: what each was checked against."""
    return [check_engine(dep, e) for e in dep.profile.engines]
