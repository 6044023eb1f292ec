"""Lab SSH: the controller's key, each node's host key and root key, sshd configs,
known_hosts and ssh_config files (controller side and inside every node)."""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.core.files import write_if_changed
from sparkdeploy.lab import layout
from sparkdeploy.lab.layout import AddressPlan
from sparkdeploy.lab.proc import run


def ensure_key(path: Path, comment: str) -> bool:
    if path.exists() and path.with_suffix(".pub").exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, path.with_suffix(".pub")):
        if p.exists():
            p.unlink()
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return True


def pub(path: Path) -> str:
    return path.with_suffix(".pub").read_text().strip()


def host_key(node: str) -> Path:
    return layout.node_dir(node) / "sshd" / "ssh_host_ed25519_key"


def node_key(node: str) -> Path:
    """The node's root key, i.e. its /root/.ssh/id_ed25519 (the private bind's backing)."""
    return layout.node_dir(node) / "ssh" / "id_ed25519"


def sshd_config_path(node: str) -> Path:
    return layout.node_dir(node) / "sshd" / "sshd_config"


def sshd_config(node: str, plan: AddressPlan, fast: bool) -> str:
    listen = [plan.mgmt_addr(node)] + ([plan.fast_addr(node)] if fast else [])
    lines = [
        "# sparkdeploy lab node " + node + " (written by lab.up)",
        "Port 22",
        *[f"ListenAddress {a}" for a in listen],
        f"HostKey {host_key(node)}",
        "PidFile none",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "AuthorizedKeysFile /root/.ssh/authorized_keys",
        "StrictModes yes",
        "UsePAM no",
        "PrintMotd no",
        "MaxSessions 64",
        "MaxStartups 64:30:128",
        "AcceptEnv LANG LC_*",
        f"SetEnv PATH={layout.NODE_PATH} DOCKER_HOST=unix://{layout.docker_socket(node)}",
        "Subsystem sftp /usr/lib/openssh/sftp-server",
    ]
    return "\n".join(lines) + "\n"


def ensure_keys(nodes: list[str]) -> list[str]:
    """Every key the lab needs; return the names of those generated now."""
    made = []
    if ensure_key(layout.CONTROLLER_KEY, "sparkdeploy-lab-controller"):
        made.append("controller")
    for node in nodes:
        if ensure_key(host_key(node), f"{node}-host"):
            made.append(f"{node} host key")
        if ensure_key(node_key(node), f"root@{node}"):
            made.append(f"{node} root key")
    return made


def write_ssh_files(nodes: list[str], plan: AddressPlan, fast: bool,
                    env_extra: dict[str, str] | None = None) -> list[str]:
    """Controller ssh_config/known_hosts/env and each node's /root/.ssh; return those changed."""
    changed = []
    hostkeys = {n: pub(host_key(n)).rsplit(" ", 1)[0] for n in nodes}
    cfg = ["# sparkdeploy lab: controller -> nodes over the management network"]
    kh = []
    for n in nodes:
        cfg += [
            f"Host {n}",
            f"  HostName {plan.mgmt_addr(n)}",
            "  User root",
            "  Port 22",
            f"  IdentityFile {layout.CONTROLLER_KEY}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {layout.KNOWN_HOSTS}",
            "  StrictHostKeyChecking yes",
            "",
        ]
        kh.append(f"{n},{plan.mgmt_addr(n)} {hostkeys[n]}")
    if write_if_changed(layout.SSH_CONFIG, "\n".join(cfg)):
        changed.append(str(layout.SSH_CONFIG))
    if write_if_changed(layout.KNOWN_HOSTS, "\n".join(kh) + "\n"):
        changed.append(str(layout.KNOWN_HOSTS))
    if write_if_changed(layout.ENV_FILE, env_text(env_extra)):
        changed.append(str(layout.ENV_FILE))
    for n in nodes:
        d = layout.node_dir(n) / "ssh"
        others = [o for o in nodes if o != n]
        auth = [pub(layout.CONTROLLER_KEY)] + [pub(node_key(o)) for o in others]
        ncfg = [f"# sparkdeploy lab: {n} -> the other nodes over the fast link"]
        nkh = []
        for o in others:
            addr = plan.fast_addr(o) if fast else plan.mgmt_addr(o)
            ncfg += [
                f"Host {o}",
                f"  HostName {addr}",
                "  User root",
                "  IdentityFile /root/.ssh/id_ed25519",
                "  IdentitiesOnly yes",
                "  StrictHostKeyChecking yes",
                "",
            ]
            nkh.append(f"{o},{plan.fast_addr(o)},{plan.mgmt_addr(o)} {hostkeys[o]}")
        files = {
            "authorized_keys": "\n".join(auth) + "\n",
            "config": "\n".join(ncfg),
            "known_hosts": "\n".join(nkh) + ("\n" if nkh else ""),
        }
        for name, text in files.items():
            if write_if_changed(d / name, text, 0o600):
                changed.append(f"{n}:/root/.ssh/{name}")
        if write_if_changed(sshd_config_path(n), sshd_config(n, plan, fast), 0o600):
            changed.append(f"{n}:sshd_config")
    return changed


def env_text(extra: dict[str, str] | None = None) -> str:
    """The shell-sourceable lab environment (part 2 adds HF_ENDPOINT and PIP_INDEX_URL)."""
    vals = {"SPARKDEPLOY_LAB_SSH_CONFIG": str(layout.SSH_CONFIG),
            "SPARKDEPLOY_LAB_KNOWN_HOSTS": str(layout.KNOWN_HOSTS),
            **(extra or {})}
    return "".join(f"export {k}={v}\n" for k, v in vals.items())
