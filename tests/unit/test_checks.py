"""The shared value checks, called directly: each good value comes back as it was, each bad
one is refused with its one line (the profile and the flags add the key or flag name)."""

from __future__ import annotations

import re

import pytest

from sparkdeploy.core import checks

LABEL = "a" * 63

def _id(check, value: str) -> str:
    """A test id that can be named on a command line (no brackets, quotes or escapes)."""
    text = f"{check.__name__}={value!r}" if check else repr(value)
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)[:60]


GOOD = [
    (checks.name, ["a", "spark-1", "0", LABEL]),
    (checks.ssh_alias, ["spark1", "ubuntu@spark1", "_x.y-z@10.0.0.2", "Spark1.LAN", "spark1.",
                        "::1", f"{LABEL}.{LABEL}.{LABEL}.{'a' * 61}"]),
    (checks.http_url, ["http://spark1:8000/v1", "https://hub.example", "http://h:1/",
                       "http://h:65535/a@b", "http://[::1]:8000", "http://10.0.0.1.:80"]),
    (checks.image_ref, ["lmsysorg/sglang:v0.5.9@sha256:" + "ab12" * 16, "Local_Image-1.x",
                        "lmsysorg/sglang@sha256:" + "0" * 64]),
    (checks.interface, ["enp1s0f0np0", "rocep1s0f0", "A_b.c:d-e", "a" * 32]),
    (checks.abs_path, ["/", "/var/run/docker.sock", "/a/..b/c", "/A_z+@-.9"]),
    (checks.no_control, ["plain text, X and é", ""]),
    (checks.profile_name, ["a", "Qwen3.5-122B_x", "a" * 128]),
    (checks.relative_path, ["docker/Dockerfile.x", "a+b@c=d-e_f", "A/..b"]),
    (checks.project_dockerfile, ["docker/Dockerfile"]),
    (checks.ssh_path, ["~/.ssh/known_hosts", "/etc/ssh/x", "rel/x", "a=b@c+d~e-f_G", ".ssh/x"]),
    (checks.node_path, ["~/venv", "/opt/venv"]),
    (checks.ssh_time, ["yes", "no", "600", "10m", "1h30m", "1H", "2S3D4W"]),
    (checks.requirement, ["transformers>=5", "a[b]==1.0"]),
    (checks.unit, ["vllm-proxy.service", "a@b.socket", "x.target", "X:y\\z.timer", "a.mount",
                   "a.path", "a.scope", "a.slice"]),
    (checks.pattern, ["*.safetensors", "a"]),
    (checks.link_address, ["10.0.0.1"]),
]


@pytest.mark.parametrize("check,value", [(c, v) for c, vs in GOOD for v in vs],
                         ids=[_id(c, v) for c, vs in GOOD for v in vs])
def test_a_good_value_comes_back(check, value):
    assert check(value) == value


_NAME = ("is not a safe name (lower-case letters, digits and '-', starting and ending with a "
         "letter or digit, at most 63)")
_ALIAS = "is not an ssh alias ([user@]host, host-name characters only)"
_PROFILE = ("is not a safe name (letters, digits, '.', '_' and '-', starting and ending with a "
            "letter or digit, at most 128)")
_REL = "is not a plain relative path (no '..', no leading '/' or '-', no empty part)"
_SSH_PATH = ("is not a plain file path (letters, digits, '_./+@=~-'; no white space, no '..', no "
             "leading '-')")
_TIME = "is not an ssh time (yes, no, or like 600, 10m, 1h30m)"
_UNIT = "is not a systemd unit name (like name.service)"
_PATTERN = "is not a file pattern (no leading '-' or '/')"

BAD = [
    (checks.name, "a" * 64, _NAME), (checks.name, "-a", _NAME), (checks.name, "a-", _NAME),
    (checks.name, "A", _NAME), (checks.name, "", _NAME), (checks.name, "a_b", _NAME),
    (checks.ssh_alias, "-oProxyCommand=x", "starts with '-' (ssh would read it as an option)"),
    (checks.ssh_alias, "@spark1", _ALIAS), (checks.ssh_alias, "1user@spark1", _ALIAS),
    (checks.ssh_alias, "u" * 33 + "@spark1", _ALIAS), (checks.ssh_alias, "spark 1", _ALIAS),
    (checks.ssh_alias, f"{LABEL}.{LABEL}.{LABEL}.{'a' * 62}", _ALIAS),
    (checks.ssh_alias, "a" * 64, _ALIAS), (checks.ssh_alias, "a..b", _ALIAS),
    (checks.http_url, "ftp://h/", "is not an http(s) URL with a host"),
    (checks.http_url, "http:///x", "is not an http(s) URL with a host"),
    (checks.http_url, "http://a..b:8000", "'a..b' is not a host name or an IP address"),
    (checks.http_url, "http://.:80/", "'.' is not a host name or an IP address"),
    (checks.http_url, f"http://{'a' * 64}.b/", "is not a host name or an IP address"),
    (checks.http_url, "http://-x:80/", "'-x' is not a host name or an IP address"),
    (checks.http_url, "http://a_b/", "'a_b' is not a host name or an IP address"),
    (checks.http_url, "http://h:0/", "port 0 is out of range (1..65535)"),
    (checks.http_url, "http://h/a b", "contains white space"),
    (checks.http_url, "http://u@h/", "must not carry credentials (user:password@): a URL reaches "
                                     "command lines, logs and image histories"),
    (checks.http_url, "http://h/\x1b[2J", r"contains a control character ('\x1b')"),
    (checks.image_ref, "-x", "is not an image reference (repo[:tag][@digest], no leading '-')"),
    (checks.image_ref, "a b", "is not an image reference (repo[:tag][@digest], no leading '-')"),
    (checks.image_ref, "a@sha256:ab12", "has a malformed digest: a pin is repo[:tag]@sha256:<64 "
     "lowercase hex digits>"),
    (checks.image_ref, "a@sha256:" + "A" * 64, "has a malformed digest: a pin is "
     "repo[:tag]@sha256:<64 lowercase hex digits>"),
    (checks.image_ref, "a@md5:" + "a" * 64, "has a malformed digest: a pin is "
     "repo[:tag]@sha256:<64 lowercase hex digits>"),
    (checks.image_ref, "a@sha256:" + "a" * 64 + "@sha256:" + "a" * 64, "has a malformed digest: "
     "a pin is repo[:tag]@sha256:<64 lowercase hex digits>"),
    (checks.interface, "a" * 33, "is not an interface name"),
    (checks.interface, "-x", "is not an interface name"),
    (checks.abs_path, "/a/../b", "is not a plain absolute path"),
    (checks.abs_path, "/a/..", "is not a plain absolute path"),
    (checks.abs_path, "a", "is not a plain absolute path"),
    (checks.abs_path, "/a b", "is not a plain absolute path"),
    (checks.no_control, "a\nb", r"contains a control character ('\n')"),
    (checks.no_control, "a\u2028b", r"contains a control character ('\u2028')"),
    (checks.no_control, "a\u2029b", r"contains a control character ('\u2029')"),
    (checks.no_control, "a\x7fb\n", r"contains a control character ('\x7f')"),
    (checks.no_control, "a\x85b", r"contains a control character ('\x85')"),
    (checks.profile_name, "a" * 129, _PROFILE), (checks.profile_name, ".a", _PROFILE),
    (checks.profile_name, "a.", _PROFILE), (checks.profile_name, "a b", _PROFILE),
    (checks.relative_path, "a//b", _REL), (checks.relative_path, "a/./b", _REL),
    (checks.relative_path, "a/../b", _REL), (checks.relative_path, "a/", _REL),
    (checks.relative_path, "-a", _REL), (checks.relative_path, "/a", _REL),
    (checks.relative_path, "", _REL),
    (checks.project_dockerfile, "dockerx/y", "is not under the project's docker/ directory"),
    (checks.ssh_path, "-o", _SSH_PATH), (checks.ssh_path, "a b", _SSH_PATH),
    (checks.ssh_path, "/a/../b", _SSH_PATH), (checks.ssh_path, "../a", _SSH_PATH),
    (checks.ssh_path, "a/..", _SSH_PATH),
    (checks.node_path, "~venv", "is not a plain absolute path (or ~/...)"),
    (checks.node_path, "venv", "is not a plain absolute path (or ~/...)"),
    (checks.node_path, "~/a b", "is not a plain absolute path (or ~/...)"),
    (checks.ssh_time, "maybe", _TIME), (checks.ssh_time, "10x", _TIME),
    (checks.ssh_time, "", _TIME), (checks.ssh_time, "m", _TIME),
    (checks.requirement, "a @ https://x.example/a.whl",
     "a requirement on a release only (no '@ URL', no '; marker')"),
    (checks.requirement, "a; python_version>'3'",
     "a requirement on a release only (no '@ URL', no '; marker')"),
    (checks.requirement, "a && b", "is not a PEP 508 requirement ("),
    (checks.requirement, "a\n", r"contains a control character ('\n')"),
    (checks.unit, "-.service", _UNIT), (checks.unit, "x.exe", _UNIT), (checks.unit, "x", _UNIT),
    (checks.pattern, "", _PATTERN), (checks.pattern, "-x", _PATTERN),
    (checks.pattern, "/x", _PATTERN), (checks.pattern, "a\tb", r"contains a control character ('\t')"),
    (checks.link_address, "spark1", "not an IP address: 'spark1'"),
    (checks.link_address, "fd00::2", "IPv6 link addresses are not supported, give the IPv4 address"),
]


@pytest.mark.parametrize("check,value,says", BAD,
                         ids=[_id(c, v) for c, v, _ in BAD])
def test_a_bad_value_is_refused_with_its_one_line(check, value, says):
    with pytest.raises(ValueError) as e:
        check(value)
    msg = str(e.value)
    assert says in msg
    assert "\n" not in msg
    if "credentials" not in says and "IP address" not in says:  # these do not repeat the value
        assert msg.startswith(f"{value!r}"), msg


def test_a_port_out_of_range_is_not_a_url():
    with pytest.raises(ValueError) as e:
        checks.http_url("http://h:99999/")
    assert str(e.value).startswith("'http://h:99999/' is not a URL (")


def test_a_requirement_that_does_not_parse_says_where_in_one_line():
    from packaging.requirements import InvalidRequirement, Requirement

    with pytest.raises(InvalidRequirement) as parsed:
        Requirement("a && b")
    first = str(parsed.value).splitlines()[0]
    with pytest.raises(ValueError) as e:
        checks.requirement("a && b")
    assert str(e.value) == f"'a && b' is not a PEP 508 requirement ({first})"


def test_control_char_names_the_first_one():
    assert checks.control_char("a\u2029b\n") == "\u2029"
    assert checks.control_char("ab\x1bc\n") == "\x1b"
    assert checks.control_char("plain X") is None


def test_hostname_is_a_name_or_an_address():
    assert checks.hostname("10.0.0.1") is True
    assert checks.hostname("fd00::2") is True
    assert checks.hostname(f"{LABEL}.{LABEL}.{LABEL}.{'a' * 61}") is True
    assert checks.hostname(f"{LABEL}.{LABEL}.{LABEL}.{'a' * 62}") is False
    assert checks.hostname("[::1]") is False


# --- a hub's file names (controller side) -------------------------------------------------------

HUB_BAD = [
    ("", "not a non-empty name of at most 1024 characters"),
    ("a" * 1025, "not a non-empty name of at most 1024 characters"),
    ("/a", "starts with / or -"), ("-a", "starts with / or -"),
    ("a\x1fb", "holds a control character or a backslash"),
    ("a\x7fb", "holds a control character or a backslash"),
    ("a\\b", "holds a control character or a backslash"),
    ("a//b", "has an empty, . or .. component"), ("a/./b", "has an empty, . or .. component"),
    ("a/../b", "has an empty, . or .. component"), ("a/", "has an empty, . or .. component"),
]


@pytest.mark.parametrize("name,why", HUB_BAD, ids=[_id(None, n) for n, _ in HUB_BAD])
def test_a_hub_file_name_that_is_unsafe_is_refused_saying_why(name, why):
    from pydantic import TypeAdapter, ValidationError

    from sparkdeploy.core.outside import HubName

    with pytest.raises(ValidationError) as e:
        TypeAdapter(HubName).validate_python(name)
    assert e.value.errors()[0]["ctx"]["error"].args[0] == f"file name {name!r:.120} refused: {why}"


@pytest.mark.parametrize("name", ["a" * 1024, "model-00001-of-00002.safetensors", "a b/c.json",
                                  "é/x", ".gitattributes", "a..b/c"])
def test_a_hub_file_name_that_is_safe_is_taken(name):
    from pydantic import TypeAdapter

    from sparkdeploy.core.outside import HubName, name_problem

    assert name_problem(name) is None
    assert TypeAdapter(HubName).validate_python(name) == name


# --- unit files ---------------------------------------------------------------------------------


def test_a_unit_file_has_every_section_and_value_on_its_own_line():
    from sparkdeploy.ops.units import unit_file

    assert unit_file({"Unit": [("Description", "x y"), ("After", "a.target")],
                      "Install": [("WantedBy", "multi-user.target")]}) == (
        "[Unit]\nDescription=x y\nAfter=a.target\n\n[Install]\nWantedBy=multi-user.target\n")


@pytest.mark.parametrize("key", ["Description\n", "Exec\x1bStart"])
def test_a_unit_key_that_would_break_its_line_is_refused(key):
    from sparkdeploy.ops.units import UnitValueError, unit_file

    with pytest.raises(UnitValueError) as e:
        unit_file({"Unit": [(key, "x")]})
    assert str(e.value) == f"{key}='x' cannot go into a unit file"


@pytest.mark.parametrize("value", ["a ", "aX"])
def test_the_last_value_of_a_unit_file_is_kept_whole(value):
    from sparkdeploy.ops.units import unit_file

    assert unit_file({"Install": [("WantedBy", value)]}) == f"[Install]\nWantedBy={value}\n"


def test_a_backslash_inside_a_unit_value_is_kept():
    from sparkdeploy.ops.units import unit_file

    assert unit_file({"Unit": [("Description", "a\\b")]}) == "[Unit]\nDescription=a\\b\n"


# --- names under a root ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a\x1bb", "a\u2028b", "a/", "a/./b", "a/../b"])
def test_under_refuses_a_name_with_a_control_character_or_an_empty_part(tmp_path, name):
    from sparkdeploy.core.files import Escape, under

    with pytest.raises(Escape) as e:
        under(tmp_path, name)
    assert str(e.value) == f"{name!r} is not a name under {tmp_path}"


def test_under_names_where_a_symlink_leads(tmp_path):
    from sparkdeploy.core.files import Escape, under

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    with pytest.raises(Escape) as e:
        under(tmp_path / "root", "out/x")
    assert str(e.value) == f"'out/x' leads out of {tmp_path / 'root'} (to {tmp_path / 'x'})"


def test_under_follows_a_symlink_that_stays_inside(tmp_path):
    from sparkdeploy.core.files import under

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert under(tmp_path, "link/x.json") == tmp_path / "link" / "x.json"
    assert under(str(tmp_path), "a..b") == tmp_path / "a..b"
