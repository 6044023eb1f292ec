import copy
import subprocess
import sys

import pytest
import yaml

from sparkdeploy.profile.config import ProfileError, load_profile
from tests.unit.profiles import ROOT, SEED, seed_data, write_profile


def mutate(fn):
    d = seed_data()
    fn(d["sparkdeploy"])
    return d


def test_seed_profile_loads():
    p = load_profile(SEED)
    assert p.head.name == "spark1"
    assert [n.name for n in p.workers] == ["spark2"]
    assert p.services.stop["spark1"] == [
        "vllm-proxy.service", "vllm-embeddings.service", "vllm-reranker.service",
        "vllm-cluster.service",
    ]
    assert [e.kind for e in p.engines] == ["sglang", "vllm-ray", "vllm"]
    assert p.bench.baseline_decode_tok_s == 27.0


def _set(path, value):
    def fn(d):
        *parents, last = path
        for k in parents:
            d = d[k]
        d[last] = value
    return fn


def _del(path):
    def fn(d):
        *parents, last = path
        for k in parents:
            d = d[k]
        del d[last]
    return fn


def _three_nodes_two_heads(d):
    extra = copy.deepcopy(d["nodes"][1])
    extra.update(name="spark3", role="head")
    extra["link"]["address"] = "192.168.100.12"
    d["nodes"].append(extra)
    for e in d["engines"]:
        e["tensor_parallel"] = 3


BAD = [
    # (id, mutation, expected message after "x.yaml: ")
    ("unknown-key", _set(["nodes", 0, "gpu"], 1), "sparkdeploy.nodes[0].gpu: unknown key"),
    ("typo-top", _set(["modle"], {}), "sparkdeploy.modle: unknown key"),
    ("bad-role", _set(["nodes", 1, "role"], "boss"),
     "sparkdeploy.nodes[1].role: must be 'head' or 'worker'"),
    ("wrong-type", _set(["nodes", 0, "gpus"], "one"),
     "sparkdeploy.nodes[0].gpus: must be an integer, not 'one'"),
    ("missing-required", _del(["model", "repo"]),
     "sparkdeploy.model.repo: required key is missing"),
    ("two-heads", _set(["nodes", 1, "role"], "head"),
     "sparkdeploy.nodes[1].role: two or more heads: exactly one node must be 'head'"),
    ("no-head", _set(["nodes", 0, "role"], "worker"),
     "sparkdeploy.nodes[0].role: no head: exactly one node must be 'head'"),
    ("dup-name", _set(["nodes", 1, "name"], "spark1"),
     "sparkdeploy.nodes[1].name: duplicate node name 'spark1' (also nodes[0])"),
    ("port-range", _set(["engines", 1, "port"], 70000),
     "sparkdeploy.engines[1].port: 70000 is out of range (1..65535)"),
    ("port-zero", _set(["engines", 0, "port"], 0),
     "sparkdeploy.engines[0].port: 0 is out of range (1..65535)"),
    ("tp-pp", _set(["engines", 0, "tensor_parallel"], 4),
     "sparkdeploy.engines[0].tensor_parallel: tensor_parallel x pipeline_parallel = 4, "
     "but the nodes declare 2 GPUs"),
    ("bad-ip", _set(["nodes", 0, "link", "address"], "192.168.100"),
     "sparkdeploy.nodes[0].link.address: not an IP address: '192.168.100'"),
    ("privilege", _set(["nodes", 0, "privilege"], "doas"),
     "sparkdeploy.nodes[0].privilege: must be 'sudo' or 'none'"),
    ("services-unknown-node", _set(["services", "stop"], {"spark9": ["x.service"]}),
     "sparkdeploy.services.stop.spark9: no node by that name"),
    ("no-candidates", _set(["images", "candidates"], []),
     "sparkdeploy.images.candidates: must not be empty"),
    ("repo-form", _set(["model", "repo"], "just-a-name"),
     "sparkdeploy.model.repo: 'just-a-name' is not of the form ^[A-Za-z0-9_][\\w.-]*/[A-Za-z0-9_][\\w.-]*$"),
    ("nodes-not-list", _set(["nodes"], {"spark1": {}}), "sparkdeploy.nodes: must be a list"),
    ("dup-address", _set(["nodes", 1, "link", "address"], "192.168.100.10"),
     "sparkdeploy.nodes[1].link.address: 192.168.100.10 is also nodes[0]'s address"),
    ("three-nodes-two-heads", _three_nodes_two_heads,
     "sparkdeploy.nodes[2].role: two or more heads: exactly one node must be 'head'"),
    # strict types: a string or a bool is never taken for a number
    ("port-string", _set(["engines", 0, "port"], "30000"),
     "sparkdeploy.engines[0].port: must be an integer, not '30000'"),
    ("gpus-bool", _set(["nodes", 0, "gpus"], True),
     "sparkdeploy.nodes[0].gpus: must be an integer, not True"),
    ("timeout-string", _set(["services", "gpu_free_timeout_s"], "120"),
     "sparkdeploy.services.gpu_free_timeout_s: must be a number, not '120'"),
    ("revision-int", _set(["model", "revision"], 2024),
     "sparkdeploy.model.revision: must be a string, not 2024"),
    # names that reach host names, paths and container names
    ("node-name-shell", _set(["nodes", 0, "name"], "spark1; rm -rf x"),
     "sparkdeploy.nodes[0].name: 'spark1; rm -rf x' is not a safe name (lower-case letters, "
     "digits and '-', starting and ending with a letter or digit, at most 63)"),
    ("engine-name-path", _set(["engines", 1, "name"], "../vllm"),
     "sparkdeploy.engines[1].name: '../vllm' is not a safe name (lower-case letters, "
     "digits and '-', starting and ending with a letter or digit, at most 63)"),
    ("dup-engine", _set(["engines", 1, "name"], "sglang"),
     "sparkdeploy.engines[1].name: duplicate engine name 'sglang'"),
    ("dist-port-is-port", _set(["engines", 0, "dist_port"], 30000),
     "sparkdeploy.engines[0].dist_port: must differ from port"),
    # URLs
    ("endpoint-not-url", _set(["endpoint"], "not a url"),
     "sparkdeploy.endpoint: 'not a url' is not an http(s) URL with a host"),
    ("endpoint-bad-port", _set(["endpoint"], "http://spark1:99999"),
     "sparkdeploy.endpoint: 'http://spark1:99999' is not a URL (Port out of range 0-65535)"),
    ("hub-endpoint-bracket", _set(["model", "endpoint"], "http://[::1"),
     "sparkdeploy.model.endpoint: 'http://[::1' is not a URL (Invalid IPv6 URL)"),
    ("index-credentials", _set(["images", "layer", "index_url"], "https://u:secret@pypi.example/simple"),
     "sparkdeploy.images.layer.index_url: must not carry credentials "
     "(user:password@): a URL reaches command lines, logs and image histories"),
    ("index-token", _set(["images", "layer", "index_url"], "https://token@pypi.example/simple"),
     "sparkdeploy.images.layer.index_url: must not carry credentials "
     "(user:password@): a URL reaches command lines, logs and image histories"),
    # option injection through the ssh destination
    ("ssh-option", _set(["nodes", 0, "ssh"], "-oProxyCommand=touch /tmp/x/pwned"),
     "sparkdeploy.nodes[0].ssh: '-oProxyCommand=touch /tmp/x/pwned' starts with '-' "
     "(ssh would read it as an option)"),
    ("ssh-space", _set(["nodes", 1, "ssh"], "spark2 -v"),
     "sparkdeploy.nodes[1].ssh: 'spark2 -v' is not an ssh alias ([user@]host, host-name "
     "characters only)"),
    ("image-option", _set(["engines", 0, "image"], "--privileged"),
     "sparkdeploy.engines[0].image: '--privileged' is not an image reference "
     "(repo[:tag][@digest], no leading '-')"),
    ("link-not-mapping", _set(["nodes", 0, "link"], 3), "sparkdeploy.nodes[0].link: must be a mapping"),
    ("timeout-zero", _set(["services", "gpu_free_timeout_s"], 0),
     "sparkdeploy.services.gpu_free_timeout_s: 0 is out of range (must be > 0.0)"),
    ("requests-zero", _set(["bench", "requests"], 0),
     "sparkdeploy.bench.requests: 0 is out of range (must be >= 1)"),
    ("gpus-float", _set(["nodes", 0, "gpus"], 1.5), "sparkdeploy.nodes[0].gpus: must be an integer, not 1.5"),
    ("socket-path", _set(["nodes", 0, "docker_socket"], "/run/docker.sock:/etc"),
     "sparkdeploy.nodes[0].docker_socket: '/run/docker.sock:/etc' is not a plain absolute path"),
    ("env-not-mapping", _set(["engines", 0, "env"], ["A=1"]), "sparkdeploy.engines[0].env: must be a mapping"),
    ("streams-above-max", _set(["model", "sync"], {"streams": 65}),
     "sparkdeploy.model.sync.streams: 65 is out of range (must be <= 64)"),
    # a kind with no wording of its own keeps pydantic's
    ("bool-string", _set(["images", "layer", "override_engine_requirement"], "yes"),
     "sparkdeploy.images.layer.override_engine_requirement: Input should be a valid boolean"),
    ("two-errors", lambda d: (_set(["nodes", 0, "gpus"], "x")(d), _set(["nodes", 1, "gpus"], "y")(d)),
     "sparkdeploy.nodes[0].gpus: must be an integer, not 'x' (and 1 more: sparkdeploy.nodes[1].gpus)"),
]


@pytest.mark.parametrize("mutation,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_profile_names_file_and_key(tmp_path, mutation, expected):
    p = write_profile(tmp_path, mutate(mutation))
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value) == f"{p}: {expected}"


FILE_CASES = [
    ("invalid-yaml", "sparkdeploy:\n  nodes: [\n", "invalid YAML: line 3, column 1: "),
    ("empty", "", "the file is empty"),
    ("comment-only", "# nothing\n", "the file is empty"),
    ("not-mapping", "- a\n- b\n", "must be a mapping with one key 'sparkdeploy', not a list"),
    ("no-top-key", "nodes: []\n", "sparkdeploy: required top-level key is missing"),
    ("extra-top-key", "sparkdeploy: {}\nother: 1\n",
     "other: unknown top-level key (only 'sparkdeploy', and 'extends')"),
    ("body-not-mapping", "sparkdeploy: 3\n", "sparkdeploy: must be a mapping"),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_bad_file(tmp_path, text, expected):
    p = write_profile(tmp_path, text)
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value).startswith(f"{p}: {expected}")
    assert "\n" not in str(e.value)


def test_non_utf8_file_is_one_line(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_bytes(b"sparkdeploy:\n  name: caf\xe9\n")
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value) == f"{p}: not UTF-8 text (byte 0xe9 at offset 24)"


def test_ssh_alias_forms_accepted(tmp_path):
    d = seed_data()
    d["sparkdeploy"]["nodes"][0]["ssh"] = "admin@spark1.lan"
    d["sparkdeploy"]["nodes"][1]["ssh"] = "192.168.100.11"
    p = load_profile(write_profile(tmp_path, d))
    assert [n.ssh for n in p.nodes] == ["admin@spark1.lan", "192.168.100.11"]


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match=r"nope.yaml: no such profile file$"):
        load_profile(tmp_path / "nope.yaml")


def test_any_number_of_nodes(tmp_path):
    d = seed_data()
    nodes = d["sparkdeploy"]["nodes"]
    for i in range(3, 5):
        n = copy.deepcopy(nodes[1])
        n["name"] = f"spark{i}"
        n["link"]["address"] = f"192.168.100.{10 + i}"
        nodes.append(n)
    for e in d["sparkdeploy"]["engines"]:
        e["tensor_parallel"] = 4
    p = load_profile(write_profile(tmp_path, d))
    assert [n.name for n in p.workers] == ["spark2", "spark3", "spark4"]


def test_inv_reports_bad_profile_in_one_line(tmp_path):
    p = write_profile(tmp_path, mutate(_set(["nodes", 1, "role"], "boss")))
    r = subprocess.run([sys.executable, "-m", "invoke", "profile.check"], cwd=ROOT,
                       capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "INVOKE_SPARKDEPLOY_PROFILE": str(p)})
    assert r.returncode == 2
    assert r.stderr.strip() == f"{p}: sparkdeploy.nodes[1].role: must be 'head' or 'worker'"
    assert "Traceback" not in r.stdout + r.stderr


def test_inv_profile_check_prints_resolved_profile():
    r = subprocess.run([sys.executable, "-m", "invoke", "profile.check"], cwd=ROOT,
                       capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "INVOKE_SPARKDEPLOY_PROFILE": str(SEED)})
    assert r.returncode == 0, r.stderr
    body = yaml.safe_load(r.stdout)
    assert body["sparkdeploy"]["nodes"][0]["docker_socket"] == "/var/run/docker.sock"
    assert body["sparkdeploy"]["services"]["gpu_free_timeout_s"] == 120


def test_ports_at_the_ends_of_the_range(tmp_path):
    def ends(d):
        d["engines"][0]["port"] = 65535
        d["engines"][0]["dist_port"] = 1
    p = load_profile(write_profile(tmp_path, mutate(ends)))
    assert (p.engines[0].port, p.engines[0].dist_port) == (65535, 1)
    with pytest.raises(ProfileError, match=r"engines\[0\]\.port: 65536 is out of range \(1\.\.65535\)$"):
        load_profile(write_profile(tmp_path, mutate(_set(["engines", 0, "port"], 65536))))


def test_engine_rules_default_when_the_profile_names_none(tmp_path):
    p = load_profile(write_profile(tmp_path, mutate(_del(["images", "rules"]))))
    sglang, vllm = p.images.rules["sglang"], p.images.rules["vllm"]
    assert (sglang.min_version, sglang.require_config) == ("0.5.9", True)
    assert sglang.model_files == ["sglang/srt/models/qwen3_5.py", "sglang/srt/models/qwen3_5_mtp.py"]
    assert (vllm.min_version, vllm.require_config) == ("0.17.0", False)
    assert vllm.model_files == ["vllm/model_executor/models/qwen3_5.py",
                                "vllm/model_executor/models/qwen3_5_mtp.py"]


def test_node_by_name():
    p = load_profile(SEED)
    assert p.node("spark2").role == "worker"
    with pytest.raises(ProfileError, match=r"^no node named 'spark9' \(nodes: spark1, spark2\)$"):
        p.node("spark9")
