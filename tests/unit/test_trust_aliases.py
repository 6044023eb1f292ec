"""``inv hosts.trust --nodes A,B [--ssh-config F]``: host keys before any profile exists, added
to the known_hosts file ssh itself checks for each alias (``ssh -G``)."""

from __future__ import annotations

import pytest
from invoke.exceptions import Exit

from sparkdeploy.node.hosts import ssh_base_argv
from sparkdeploy.profile.config import SshSettings
from sparkdeploy.tasks.hosts import trust
from tests.unit.fakes import FakeContext

KEY = {"spark1": "10.1.2.3 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOne",
       "spark2": "10.1.2.4 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITwo"}


class Keys(FakeContext):
    """This machine's ssh answering for an ssh_config whose UserKnownHostsFile is ``kh``."""

    def __init__(self, kh, dry=False):
        super().__init__(dry)
        self._set("kh", kh)

    def answer(self, alias, argv, stdin, command, kw):
        assert alias is None, command  # all of it runs here, none on a node
        if "-G" in argv:
            ip = KEY[argv[-1]].split()[0]
            return self.result(command, stdout=f"hostname {ip}\nport 22\nuserknownhostsfile "
                                               f"{self.kh} ~/.ssh/known_hosts2\n")
        if argv[:2] == ["ssh-keygen", "-F"]:
            known = self.kh.read_text() if self.kh.exists() else ""
            return self.result(command, 0 if argv[2] in known else 1,
                               "\n".join(ln for ln in known.splitlines() if ln.startswith(argv[2])))
        if argv[0] == "ssh-keyscan":
            return self.result(command, stdout=next(k for k in KEY.values() if k.startswith(argv[-1])) + "\n")
        assert argv == ["ssh-keygen", "-l", "-f", "-"], argv
        return self.result(command, stdout=f"256 SHA256:{stdin.split()[0]} (ED25519)\n")


def test_trust_by_aliases_adds_each_key_where_ssh_looks(tmp_path, capsys):
    kh, cfg = tmp_path / "known_hosts", tmp_path / "ssh_config"
    cfg.write_text("Host spark1 spark2\n")
    ctx = Keys(kh)
    trust(ctx, nodes="spark1,spark2", ssh_config=str(cfg), yes=True)
    assert kh.read_text() == KEY["spark1"] + "\n" + KEY["spark2"] + "\n"
    assert ctx.calls[0] == (None, [*ssh_base_argv(SshSettings(config=str(cfg))), "-G", "--", "spark1"])
    assert f"added 256 SHA256:10.1.2.4 (ED25519) to {kh}" in capsys.readouterr().out
    trust(ctx, nodes="spark1,spark2", ssh_config=str(cfg), yes=True)
    assert capsys.readouterr().out.count("already in") == 2


def test_trust_by_aliases_under_dry_run_adds_nothing(tmp_path, capsys):
    kh = tmp_path / "known_hosts"
    trust(Keys(kh, dry=True), nodes="spark1", yes=True)
    assert not kh.exists()
    assert "would ask to add 256 SHA256:10.1.2.3 (ED25519)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, line", [
    ({"ssh_config": "/x"}, "--ssh-config: only with --nodes (a profile names its own ssh_config)"),
    ({"nodes": "spark1", "node": "spark1"}, "--nodes: the same as --node: give one of them"),
    ({"nodes": "spark1", "ssh_config": "/nonexistent"}, "--ssh-config: /nonexistent: no such file"),
    ({"nodes": "a b"}, "--nodes: 'a b' is not an ssh alias ([user@]host, host-name characters only)"),
])
def test_trust_by_aliases_doors(tmp_path, flags, line):
    ctx = Keys(tmp_path / "known_hosts")
    with pytest.raises(Exit) as e:
        trust(ctx, **flags)
    assert (e.value.code, e.value.message) == (2, line)
    assert ctx.calls == []
