"""The serve_node.py helper against files laid out as a node's sysfs and model directory."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

from sparkdeploy.core.packaged import helper

SCRIPT = helper("serve_node.py")
spec = importlib.util.spec_from_file_location("serve_node", SCRIPT)
sn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sn)


def gid(root: Path, hca: str, n: int, value: str, kind: str | None, ndev: str = "enp1s0f0np0"):
    port = root / hca / "ports" / "1"
    (port / "gids").mkdir(parents=True, exist_ok=True)
    (port / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
    (port / "gid_attrs" / "ndevs").mkdir(parents=True, exist_ok=True)
    (port / "gids" / str(n)).write_text(value + "\n")
    if kind is not None:
        (port / "gid_attrs" / "types" / str(n)).write_text(kind + "\n")
    (port / "gid_attrs" / "ndevs" / str(n)).write_text(ndev + "\n")


def test_gid_index_is_the_roce_v2_entry_of_the_address(tmp_path, monkeypatch):
    monkeypatch.setattr(sn, "IB", str(tmp_path))
    link_local = "fe80:0000:0000:0000:0000:0000:0000:0001"
    mapped = "0000:0000:0000:0000:0000:ffff:c0a8:640a"  # 192.168.100.10
    gid(tmp_path, "rocep1s0f0", 0, link_local, "IB/RoCE v1")
    gid(tmp_path, "rocep1s0f0", 1, link_local, "RoCE v2")
    gid(tmp_path, "rocep1s0f0", 2, mapped, "IB/RoCE v1")
    gid(tmp_path, "rocep1s0f0", 5, mapped, "RoCE v2")
    gid(tmp_path, "rocep1s0f0", 6, "0000:0000:0000:0000:0000:0000:0000:0000", None)
    got = sn.gid_facts(["rocep1s0f0", "roceP2p1s0f0"], "192.168.100.10", "enp1s0f0np0")
    assert (got["index"], got["hca"]) == (5, "rocep1s0f0")
    assert got["why"] == "roceP2p1s0f0: absent"
    none = sn.gid_facts(["rocep1s0f0"], "192.168.100.11", "enp1s0f0np0")
    assert none["index"] is None and none["why"] == "rocep1s0f0: no RoCE v2 GID for 192.168.100.11"


def test_model_presence_follows_the_safetensors_index(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    got = sn.model_facts(str(tmp_path))
    assert not got["present"] and got["missing"] == ["model-00002-of-00002.safetensors"]
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"y")
    assert sn.model_facts(str(tmp_path))["present"]


def test_a_listening_port_is_taken_and_a_closed_one_free():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        got = sn.port_facts([port])
        assert got[str(port)]["free"] is False
        assert got[str(port)]["owner"].startswith("pid ")
        assert sn.connect("127.0.0.1", port)["open"] is True
    finally:
        s.close()
    assert sn.port_facts([port])[str(port)] == {"free": True}
    refused = sn.connect("127.0.0.1", port)
    assert refused == {"open": False, "reachable": True, "why": "connection refused"}


@pytest.mark.parametrize("argv", [["facts", "--iface", "lo", "--addr", "127.0.0.1"]])
def test_facts_prints_one_json_object(argv, capsys):
    assert sn.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iface"]["exists"] and "127.0.0.1" in out["iface"]["addrs"]
    assert out["gid"]["index"] is None and out["peers"] == {}
