"""``cluster.discover``: a profile from nothing but SSH aliases.

Each node is read once (``helpers/cluster_node.py facts``: architecture, GPUs, the memory they
can use, free disk under the model path, Docker, privilege, rsync and python3, the fast-link
candidates); the link is the subnet every node reaches on one RDMA-backed interface that is up
with an IPv4 address and whose peers answer the head there. What was found, and every warning,
is a result; the profile (``discovered.render``) is validated by the profile loader, then
written (``write``) or handed to the task to print (the last result's ``profile`` detail).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from invoke import Context

from sparkdeploy.core import packaged
from sparkdeploy.core.errors import PartFailed, StepFailed
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.node.discover import (
    Link,
    NodeFacts,
    link_warnings,
    pick_link,
    read_answers,
    read_node,
)
from sparkdeploy.node.discover_profile import Found, render
from sparkdeploy.node.hosts import Host, HostError, NodeUnreachable
from sparkdeploy.ops.hosts import probe_hosts
from sparkdeploy.profile.config import ProfileError, SshSettings, load_profile
from sparkdeploy.steps.registry import StepContext, step

STEP = "cluster.discover"
GB = 1000 ** 3


def trust_hint(hosts: list[Host], ssh: SshSettings) -> str:
    cfg = f" --ssh-config {ssh.config}" if ssh.config else ""
    return f"inv hosts.trust --nodes {','.join(h.node.ssh or h.name for h in hosts)}{cfg}"


def unreachable_why(e: NodeUnreachable, hint: str) -> str:
    if "Host key verification failed" in e.why or "host key is known" in e.why:
        return f"its host key is not known here: run `{hint}` first"
    return f"unreachable: {e.why}"


def _read_all(ctx: StepContext, hosts: list[Host], model_path: str,
              hint: str) -> dict[str, NodeFacts] | None:
    def one(host: Host) -> NodeFacts | None:
        try:
            return read_node(host, model_path)
        except NodeUnreachable as e:
            raise PartFailed(unreachable_why(e, hint), host.name) from None
        except HostError as e:
            why = str(e).removeprefix(f"{host.name}: ")
            if "python3" in why and "not found" in why:
                why = "python3 is not installed (sparkdeploy's node helpers need it)"
            raise PartFailed(why, host.name) from None

    got = ctx.each(hosts, one, parallel=True)
    if any(f is None for f in got):
        return None
    return {h.name: f for h, f in zip(hosts, got, strict=True) if f is not None}


def judge_node(f: NodeFacts) -> tuple[list[str], list[str], list[str]]:
    """(what was found, warnings, problems that stop a deployment) of one node."""
    found, warn, bad = [], [], []
    m = f.memory
    if f.arch is None:
        bad.append(f"architecture {f.machine!r} (uname -m) is neither arm64 nor amd64")
    if m.gpus == 0:
        bad.append(f"no GPU: {m.why or 'nvidia-smi lists none'}")
    found.append(f"{f.arch or f.machine} (uname -m: {f.machine}); {m.gpus} GPU(s): "
                 f"{', '.join(m.names) or 'none'}; memory: {m.line()}")
    d = f.disk
    found.append(f"disk: {d.free / GB:.1f} GB free under {d.path} (filesystem at {d.mount})"
                 if d.free is not None else f"disk: free space under {d.path} not read: {d.why}")
    k = f.docker
    if k.why:
        bad.append(f"Docker at {k.socket} ({k.socket_from}) does not answer: {k.why}")
    else:
        found.append(f"Docker {k.version} at {k.socket} ({k.socket_from}): image store "
                     f"{k.store} ({k.driver}), runtimes {', '.join(k.runtimes) or 'none'}")
        if not k.nvidia_runtime:
            warn.append("Docker has no nvidia runtime (the NVIDIA Container Toolkit)")
    p = f.privilege
    if p.root:
        found.append(f"privilege: root ({f.user})")
    elif p.sudo == "ok":
        found.append(f"privilege: sudo without a password ({f.user})")
    elif p.sudo == "password":
        bad.append(f"sudo asks {f.user} for a password: deployments need it without one "
                   f"(a NOPASSWD rule for {f.user}) or root")
    else:
        bad.append(f"{f.user} is not root and cannot use sudo: {p.why}")
    found.append(f"python3 {f.python} ({f.tools.get('python3')}), rsync "
                 f"{f.tools.get('rsync') or 'absent'}")
    if not f.tools.get("rsync"):
        bad.append("rsync is not installed (model.sync copies the weights with it)")
    return found, warn, bad


def _report_nodes(ctx: StepContext, found: dict[str, NodeFacts]) -> bool:
    """Each node's findings as results; False when one stops a deployment."""
    clean = True
    for name, f in found.items():
        seen, warn, bad = judge_node(f)
        for line in seen:
            ctx.ok(line, name)
        for line in warn:
            ctx.ok(f"warning: {line}", name)
        for line in bad:
            ctx.failed(line, name)
        clean = clean and not bad
    return clean


def _peers_answer(head: Host, link: Link) -> list[str]:
    """Why peers on ``link`` do not answer the head (empty: all answered)."""
    mine, peers = link.ends[0], link.ends[1:]
    if not peers:
        return []
    got = read_answers(head, mine.address, [e.address for e in peers])
    return [f"{e.node} {e.address}: {got[e.address].how}" for e in peers
            if e.address not in got or not got[e.address].answered]


def choose_link(ctx: StepContext, hosts: list[Host], found: dict[str, NodeFacts],
                interface: str | None) -> Link | None:
    links = pick_link({n: f.link for n, f in found.items()}, interface)  # LinkRefused: the step fails
    silent = {lk.subnet: _peers_answer(hosts[0], lk) for lk in links}
    answering = [lk for lk in links if not silent[lk.subnet]]
    if len(answering) == 1:
        link = answering[0]
        peers = " (every peer answered the head on it)" if len(link.ends) > 1 else ""
        ctx.ok(f"fast link: {link.show()}{peers}")
        return link
    if not answering:
        ctx.failed("no peer answers the head on the link: " + "; ".join(
            f"{lk.show()}: {', '.join(silent[lk.subnet])}" for lk in links))
    else:
        ctx.failed(f"{len(answering)} candidate links, which one is ambiguous: "
                   + "; ".join(lk.show() for lk in answering) + " (choose with --interface)")
    return None


def _found(host: Host, f: NodeFacts, link: Link) -> Found:
    end = next(e for e in link.ends if e.node == host.name)
    p = f.privilege
    return Found(
        name=host.name, alias=host.node.ssh or host.name, role=host.node.role, end=end,
        gpus=f.memory.gpus, gpus_from=f"nvidia-smi: {', '.join(f.memory.names) or 'no GPU'}",
        docker_socket=f.docker.socket,
        docker_from=f"{f.docker.socket_from}; Docker {f.docker.version} answered on it",
        privilege="none" if p.root else "sudo",
        privilege_from=_privilege_from(f),
        arch=f.arch or f.machine, arch_from=f"uname -m: {f.machine}")


def _privilege_from(f: NodeFacts) -> str:
    p = f.privilege
    if p.root:
        return f"the SSH user {f.user} is root: no sudo needed"
    if p.sudo == "ok":
        return f"sudo -n true works for {f.user}"
    return f"{f.user} is not root; sudo -n true: {p.sudo} (see the failed result)"


def validate(text: str, where: Path, shown: str) -> None:
    """The profile loader's verdict on ``text`` as a file in ``where`` (ProfileError naming
    the file ``shown``)."""
    with tempfile.NamedTemporaryFile("w", dir=where, prefix=".discovered.", suffix=".yaml") as t:
        t.write(text)
        t.flush()
        try:
            load_profile(t.name)
        except ProfileError as e:
            raise ProfileError(str(e).replace(t.name, shown)) from None


def deliver(ctx: StepContext, text: str, target: Path | None, dry: bool) -> None:
    """Validate the profile, then write it to ``target`` (whole or not at all) or hand it over
    to be printed (the result's ``profile``)."""
    try:
        validate(text, target.parent if target is not None else Path(tempfile.gettempdir()),
                 str(target or "the profile"))
    except ProfileError as e:
        raise StepFailed(f"the discovered profile does not validate: {e}") from None
    if target is None:
        ctx.ok("the profile (validated) follows", profile=text)
        return
    old = target.read_text(errors="replace") if target.is_file() else None
    if old == text:
        ctx.ok(f"{target} already holds this profile", written=str(target))
    elif dry:
        ctx.would(f"write {target}" + (" (replacing what it holds)" if old is not None else ""))
    else:
        write_text_atomic(target, text)
        ctx.changed(f"{'replaced' if old is not None else 'wrote'} {target} (validated)",
                    written=str(target))


@step(STEP)
def discover(ctx: StepContext, nodes: list[tuple[str, str]], ssh: SshSettings | None = None,
             runner: Context | None = None, write: Path | None = None,
             interface: str | None = None, command: str = "inv cluster.discover",
             recipe: str | None = None, recipes: tuple[str, ...] = ()) -> None:
    """Read every node of ``nodes`` ((name, ssh alias), the head first), pick the fast link,
    then write the profile to ``write`` or hand it over to be printed (``recipe``: the profile
    says ``recipe: NAME``; ``recipes``: owners' recipe directories)."""
    ssh = ssh or SshSettings()
    hosts = probe_hosts(nodes, ssh, runner, ctx.events)
    seed = load_profile(packaged.data(packaged.SEED_PROFILE), recipe, recipes)
    found = _read_all(ctx, hosts, seed.model.path, trust_hint(hosts, ssh))
    if found is None:
        ctx.failed("not every node could be read: no profile")
        return
    _report_nodes(ctx, found)
    link = choose_link(ctx, hosts, found, interface)
    if link is None:
        return
    for h in hosts:
        for line in link_warnings(found[h.name].link, next(e for e in link.ends if e.node == h.name)):
            ctx.ok(f"warning: {line}", h.name)
    text = render([_found(h, found[h.name], link) for h in hosts], ssh_config=ssh.config,
                  seed_nodes=list(seed.services.stop), target=write, command=command,
                  recipe=recipe, recipes=[str(Path(d).resolve()) for d in recipes])
    deliver(ctx, text, write, hosts[0].dry)

