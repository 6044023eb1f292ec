"""sparkdeploy.lab.images: wheel stripping, recipe hash, Dockerfile shape, the ok/changed logic."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import threading
import zipfile
from pathlib import Path

import docker
import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab import images, layout

# --- wheels ------------------------------------------------------------------------------------

MEMBERS = {
    "eng/__init__.py": b"__version__ = '1.0'\n",
    "eng/_C.abi3.so": b"\x7fELF compiled",
    "eng/ops/_moe.cpython-311-x86_64-linux-gnu.so": b"\x7fELF moe",
    "eng/libs/libcudart.so.12.8": b"\x7fELF cudart",
    "eng/models/qwen3_5.py": b"class Qwen3_5: pass\n",
    "eng/so_what.py": b"x = 1\n",
    "eng-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: eng\nVersion: 1.0\n",
    "eng-1.0.dist-info/entry_points.txt": b"[console_scripts]\neng = eng.cli:main\n",
}


def make_wheel(path: Path) -> Path:
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    for name, data in MEMBERS.items():
        w.writerow([name, "sha256=x", str(len(data))])
    w.writerow(["eng-1.0.dist-info/RECORD", "", ""])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in MEMBERS.items():
            z.writestr(zipfile.ZipInfo(name, date_time=(2025, 1, 2, 3, 4, 6)), data)
        z.writestr(zipfile.ZipInfo("eng-1.0.dist-info/RECORD", date_time=(2025, 1, 2, 3, 4, 6)),
                   record.getvalue())
    return path


@pytest.mark.parametrize("name,compiled", [
    ("a.so", True),
    ("pkg/_C.abi3.so", True),
    ("pkg/x.cpython-311-x86_64-linux-gnu.so", True),
    ("pkg.libs/libcudart.so.12", True),
    ("pkg.libs/libfoo.so.1.2.3", True),
    ("pkg/so.py", False),
    ("pkg/x.sox", False),
    ("pkg/x.so.py", False),
    ("pkg/x.pyi", False),
])
def test_is_compiled(name, compiled):
    assert images.is_compiled(name) is compiled


def test_strip_wheel_drops_libraries_and_their_record_rows(tmp_path):
    src = make_wheel(tmp_path / "eng-1.0-cp38-abi3-manylinux_2_31_x86_64.whl")
    dst = tmp_path / "out" / src.name
    dropped = images.strip_wheel(src, dst)
    assert sorted(dropped) == ["eng/_C.abi3.so", "eng/libs/libcudart.so.12.8",
                               "eng/ops/_moe.cpython-311-x86_64-linux-gnu.so"]
    with zipfile.ZipFile(dst) as z:
        names = z.namelist()
        assert names == ["eng/__init__.py", "eng/models/qwen3_5.py", "eng/so_what.py",
                         "eng-1.0.dist-info/METADATA", "eng-1.0.dist-info/entry_points.txt",
                         "eng-1.0.dist-info/RECORD"]
        for n in names[:-1]:
            assert z.read(n) == MEMBERS[n]
        rows = list(csv.reader(io.StringIO(z.read("eng-1.0.dist-info/RECORD").decode())))
    assert [r[0] for r in rows] == names
    assert not (tmp_path / "out" / (src.name + ".tmp")).exists()


def test_strip_wheel_is_byte_for_byte_deterministic(tmp_path):
    src = make_wheel(tmp_path / "eng-1.0-py3-none-any.whl")
    images.strip_wheel(src, tmp_path / "a" / src.name)
    images.strip_wheel(src, tmp_path / "b" / src.name)
    assert (tmp_path / "a" / src.name).read_bytes() == (tmp_path / "b" / src.name).read_bytes()


def test_engine_wheel_downloaded_once_without_deps_then_stripped_once(tmp_path, monkeypatch):
    cache, stripped = tmp_path / "wheels", tmp_path / "stripped"
    calls: list[list[str]] = []

    def runner(argv, **kw):
        calls.append(argv)
        make_wheel(Path(argv[argv.index("--dest") + 1]) / "eng-1.0-cp38-abi3-linux_x86_64.whl")
        return subprocess.CompletedProcess(argv, 0, "", "")

    recipe = images.ImageSpec("x/eng:1", "vllm", "eng==1.0", ("dep==2",), strip_compiled=True)
    out = images.ensure_engine_wheel(recipe, cache, stripped, runner=runner)
    assert len(calls) == 1
    argv = calls[0]
    assert argv[argv.index("download") + 1] == "--no-deps"
    assert argv[-1] == "eng==1.0" and "--only-binary=:all:" in argv
    assert out == stripped / "eng-1.0-cp38-abi3-linux_x86_64.whl"
    assert (cache / out.name).exists()
    with zipfile.ZipFile(out) as z:
        assert not [n for n in z.namelist() if images.is_compiled(n)]
    mtime = out.stat().st_mtime_ns
    assert images.ensure_engine_wheel(recipe, cache, stripped, runner=runner) == out
    assert len(calls) == 1 and out.stat().st_mtime_ns == mtime


def test_unstripped_engine_wheel_is_the_cached_file(tmp_path):
    cache = tmp_path / "wheels"
    cache.mkdir()
    whl = make_wheel(cache / "sglang-0.5.4-py3-none-any.whl")
    make_wheel(cache / "sglang-0.5.40-py3-none-any.whl")

    def runner(argv, **kw):
        raise AssertionError("no download when the wheel is cached")

    recipe = images.ImageSpec("lmsysorg/sglang:spark", "sglang", "sglang==0.5.4", ())
    assert images.ensure_engine_wheel(recipe, cache, tmp_path / "s", runner=runner) == whl


# --- recipe hash and Dockerfile ------------------------------------------------------------------

RECIPE = images.COMMUNITY_IMAGES[2]


def test_recipe_hash_is_stable_and_follows_every_input():
    h = images.recipe_hash(RECIPE, "sha256:base", b"standin")
    assert h == images.recipe_hash(RECIPE, "sha256:base", b"standin")
    assert len(h) == 32
    others = {
        images.recipe_hash(RECIPE, "sha256:other-base", b"standin"),
        images.recipe_hash(RECIPE, "sha256:base", b"standin v2"),
        images.recipe_hash(images.ImageSpec(RECIPE.tag, "vllm", "vllm==0.17.0", RECIPE.requires,
                                         True), "sha256:base", b"standin"),
        images.recipe_hash(images.ImageSpec(RECIPE.tag, "vllm", RECIPE.engine_requirement,
                                         RECIPE.requires, False), "sha256:base", b"standin"),
    }
    assert h not in others and len(others) == 4


def test_community_recipes_pin_the_seed_versions_without_torch():
    by_tag = {r.tag: r for r in images.COMMUNITY_IMAGES}
    assert by_tag["lmsysorg/sglang:spark"].engine_requirement == "sglang==0.5.4"
    assert by_tag["scitrera/dgx-spark-sglang:0.5.10rc0"].engine_requirement == "sglang==0.5.10rc0"
    vllm = by_tag["hellohal2064/vllm-qwen3.5-gb10"]
    assert vllm.engine_requirement.startswith("vllm==0.17.") and vllm.strip_compiled
    assert any(r.startswith("ray==2.") for r in vllm.requires)
    for r in images.COMMUNITY_IMAGES:
        assert "transformers==4.57.1" in r.requires
        assert not [q for q in r.requires if q.split("==")[0] in ("torch", "vllm", "sglang")]


def test_dockerfile_keeps_wheels_out_of_the_final_stage():
    labels = {layout.STANDIN_LABEL: "true", images.RECIPE_LABEL: "abc"}
    text = images.dockerfile(RECIPE, "sparkdeploy-lab/base:bookworm", "vllm-0.17.1-x.whl", labels)
    build, final = text.split("\n\n", 1)
    assert build.startswith("FROM sparkdeploy-lab/base:bookworm AS build\n")
    assert "--no-deps /tmp/wheels/engine/vllm-0.17.1-x.whl" in build
    assert '--find-links /tmp/wheels/deps "transformers==4.57.1" "ray==2.60.0"' in build
    assert "--no-index" in build
    assert final.startswith("FROM sparkdeploy-lab/base:bookworm\n")
    assert "wheels" not in final
    assert "COPY --from=build /opt/venv /opt/venv" in final
    assert "ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:" in final
    assert 'org.sparkdeploy.lab.standin="true"' in final
    assert 'org.sparkdeploy.lab.recipe="abc"' in final


# --- build_community_images against a fake engine -------------------------------------------------


BASE = {"Id": "sha256:base", "RootFS": {"Type": "layers", "Layers": ["sha256:l1"]}}


class FakeAPI:
    def __init__(self, images_: dict[str, dict]):
        self.images_ = images_  # ref -> inspect answer
        self.builds: list[tuple[str, str]] = []
        self.loads = 0

    def inspect_image(self, ref):
        if ref not in self.images_:
            raise docker.errors.ImageNotFound(ref)
        return self.images_[ref]

    def build(self, path, tag, **kw):
        assert kw["network_mode"] == "none" and kw["pull"] is False
        dockerfile = (Path(path) / "Dockerfile").read_text()
        self.builds.append((tag, dockerfile))
        label = dockerfile.split(f'{images.RECIPE_LABEL}="', 1)[1].split('"', 1)[0]
        self.images_[tag] = {"Id": f"sha256:new-{tag}", "Size": 123,
                             "Config": {"Labels": {images.RECIPE_LABEL: label,
                                                   layout.STANDIN_LABEL: "true"}}}
        yield {"stream": "Step 1/14 : FROM base AS build\n"}
        yield {"stream": f"Successfully tagged {tag}\n"}

    def get_image(self, ref):
        data = json.dumps({ref: self.inspect_image(ref)}).encode()
        yield data[:10]
        yield data[10:]

    def load_image(self, fh, quiet):
        self.loads += 1
        self.images_.update(json.loads(fh.read()))
        yield {"stream": "Loaded image"}

    def images(self, **kw):
        return []

    def close(self):
        pass

    def tag(self, image, repository, tag):
        self.images_[f"{repository}:{tag}"] = self.images_[image]

    def remove_image(self, *a, **kw):
        raise AssertionError("nothing to remove")

    def prune_images(self, filters):
        assert filters == {"dangling": True, "label": f"{images.STAGE_LABEL}=true"}


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    api = FakeAPI({layout.BASE_IMAGE: BASE})
    monkeypatch.setattr(docker, "APIClient", lambda **kw: api)
    engine = tmp_path / "cache" / "eng-1.0-py3-none-any.whl"
    engine.parent.mkdir()
    make_wheel(engine)
    dep = tmp_path / "cache" / "dep-2-py3-none-any.whl"
    dep.write_bytes(b"dep")
    monkeypatch.setattr(images, "ensure_engine_wheel", lambda r, c, s: engine)
    monkeypatch.setattr(images, "dependency_wheels", lambda r, c, w: [dep])
    cache, archives = tmp_path / "cache", tmp_path / "archives"

    def build(base=layout.BASE_IMAGE, **kw):
        kw.setdefault("archive_dir", archives)
        return images.build_community_images("unix:///x.sock", base, cache_dir=cache, **kw)

    return api, build, archives


def test_builds_what_is_missing_then_is_ok(fake_engine):
    api, build, archives = fake_engine
    lines: list[str] = []
    first = build(node="spark1", log=lines.append)
    assert [r.status for r in first] == [Status.CHANGED] * 3
    assert [t for t, _ in api.builds] == [r.tag for r in images.COMMUNITY_IMAGES]
    assert all(r.node == "spark1" and r.details["size"] == 123 for r in first)
    assert "Successfully tagged lmsysorg/sglang:spark" in lines
    second = build(node="spark1")
    assert [r.status for r in second] == [Status.OK] * 3
    assert len(api.builds) == 3
    assert [r.details["recipe"] for r in second] == [r.details["recipe"] for r in first]


def test_the_recipes_vllm_images_are_the_labs_vllm_image_by_other_names(fake_engine):
    api, build, _ = fake_engine
    build(archive_dir=None)
    vllm = api.images_["hellohal2064/vllm-qwen3.5-gb10"]["Id"]
    for ref in ("sparkarena/spark-vllm-docker:mxfp4", "nvcr.io/nvidia/vllm:25.11-py3"):
        assert api.images_[ref]["Id"] == vllm
    del api.images_["sparkarena/spark-vllm-docker:mxfp4"]
    assert [r.status for r in build(archive_dir=None)] == [Status.OK] * 3  # named again
    assert api.images_["sparkarena/spark-vllm-docker:mxfp4"]["Id"] == vllm


def test_a_tag_with_another_recipe_or_no_standin_label_is_rebuilt(fake_engine):
    api, build, _ = fake_engine
    build(archive_dir=None)
    api.images_["lmsysorg/sglang:spark"]["Config"]["Labels"][images.RECIPE_LABEL] = "old"
    del api.images_["hellohal2064/vllm-qwen3.5-gb10"]["Config"]["Labels"][layout.STANDIN_LABEL]
    again = build(archive_dir=None)
    assert [r.status for r in again] == [Status.CHANGED, Status.OK, Status.CHANGED]
    assert "rebuilt" in again[0].why


def test_missing_base_image_fails_each_image_in_one_line(fake_engine):
    api, build, _ = fake_engine
    res = build("nope:1")
    assert [r.status for r in res] == [Status.FAILED] * 3
    assert "base image nope:1 not on this dockerd" in res[0].why and api.builds == []


def test_a_failed_build_is_one_line_and_the_others_still_build(fake_engine, monkeypatch):
    api, build_all, _ = fake_engine
    real_build = api.build

    def build(path, tag, **kw):
        if tag.startswith("scitrera/"):
            yield {"stream": "ERROR: No matching distribution found for x\n"}
            yield {"error": "The command '/bin/sh -c ...' returned a non-zero code: 1",
                   "errorDetail": {"message": "The command returned a non-zero code: 1"}}
            return
        yield from real_build(path, tag, **kw)

    monkeypatch.setattr(api, "build", build)
    res = build_all()
    assert [r.status for r in res] == [Status.CHANGED, Status.FAILED, Status.CHANGED]
    assert "\n" not in res[1].why and "non-zero code: 1" in res[1].why
    assert "No matching distribution" in res[1].why


def test_built_images_are_archived_and_a_fresh_engine_loads_them(fake_engine):
    api, build, archives = fake_engine
    first = build()
    assert all(r.why.endswith("s; archived") for r in first)
    names = sorted(p.name for p in archives.iterdir())
    assert names == sorted(f"{re.sub(r'[^A-Za-z0-9.]+', '_', r.details['image'])}-"
                           f"{r.details['recipe']}.tar" for r in first)
    # a fresh lab: same base layers under a new base image ID, no community image
    api.images_ = {layout.BASE_IMAGE: {**BASE, "Id": "sha256:reimported"}}
    api.builds.clear()
    again = build()
    assert [r.status for r in again] == [Status.CHANGED] * 3
    assert all("loaded from the archive" in r.why for r in again)
    assert api.builds == [] and api.loads == 3
    assert [r.details["recipe"] for r in again] == [r.details["recipe"] for r in first]
    assert [r.status for r in build()] == [Status.OK] * 3


def test_a_fresh_engine_loads_the_archives_side_by_side(fake_engine, monkeypatch):
    api, build, _ = fake_engine
    build()
    api.images_ = {layout.BASE_IMAGE: BASE}
    together = threading.Barrier(3, timeout=5)  # broken unless the three loads overlap
    loading = api.load_image

    def load_image(fh, quiet):
        together.wait()
        yield from loading(fh, quiet)

    monkeypatch.setattr(api, "load_image", load_image)
    again = build()
    assert [r.status for r in again] == [Status.CHANGED] * 3, [r.why for r in again]
    assert all("loaded from the archive" in r.why for r in again)


def test_a_failed_load_is_one_line_and_the_others_still_load(fake_engine, monkeypatch):
    api, build, _ = fake_engine
    build()
    api.images_, api.builds = {layout.BASE_IMAGE: BASE}, []
    loading = api.load_image

    def load_image(fh, quiet):
        if "scitrera" in fh.name:
            yield {"error": "write /var/lib/docker/tmp/x: no space left on device"}
            return
        yield from loading(fh, quiet)

    monkeypatch.setattr(api, "load_image", load_image)
    res = build()
    assert [r.status for r in res] == [Status.CHANGED, Status.FAILED, Status.CHANGED]
    assert res[1].why.startswith("scitrera/dgx-spark-sglang:0.5.10rc0: docker load scitrera_")
    assert res[1].why.endswith(": no space left on device") and api.builds == []


def test_a_new_recipe_replaces_its_tags_archive(fake_engine):
    api, build, archives = fake_engine
    build()
    before = {p.name for p in archives.iterdir()}
    api.images_[layout.BASE_IMAGE] = {"Id": "sha256:b2", "RootFS": {"Layers": ["sha256:l2"]}}
    build()
    after = {p.name for p in archives.iterdir()}
    assert len(after) == 3 and not before & after


def test_prefetch_fetches_every_recipes_wheels_and_says_what_is_new(tmp_path, monkeypatch):
    cache = tmp_path / "wheels"
    cache.mkdir()
    seen: list[tuple[str, str]] = []

    def engine(r, c, s):
        seen.append(("engine", r.engine_requirement))
        (c / f"{r.engine_name}-{r.engine_version}-py3-none-any.whl").write_bytes(b"x" * 2**20)

    monkeypatch.setattr(images, "ensure_engine_wheel", engine)
    monkeypatch.setattr(images, "dependency_wheels",
                        lambda r, c, w: seen.append(("deps", ";".join(r.requires))))
    did, why = images.prefetch_wheels(cache=cache, stripped_cache=tmp_path / "s")
    assert did and why == "3 wheels downloaded (3 MB)"
    assert [k for k, _ in seen] == ["engine", "deps"] * 3
    assert images.prefetch_wheels(cache=cache, stripped_cache=tmp_path / "s") == (
        False, "engine and dependency wheels cached")


def test_the_images_carry_both_nccl_libraries_files_where_pip_and_dpkg_put_them(tmp_path):
    """The probe reads real files: the nvidia-nccl-cu13 wheel in the venv (its dist-info names it)
    and libnccl2 in /usr/lib/<triplet> with its dpkg status stanza."""
    text = images.dockerfile(RECIPE, "base", "vllm-0.17.1-x.whl", {})
    build, final = text.split("\n\n", 1)
    assert "COPY nccl/site /tmp/nccl-site" in build
    assert "COPY nccl/system /tmp/nccl" in final
    assert 'ln -s libnccl.so.2.28.9 "$d/libnccl.so.2"' in final
    files = images.nccl_site_files()
    assert files["nvidia/nccl/lib/libnccl.so.2"] == images.NCCL_FAKE
    meta = files["nvidia_nccl_cu13-2.28.9.dist-info/METADATA"].decode()
    assert "Name: nvidia-nccl-cu13\nVersion: 2.28.9\n" in meta
    assert images.NCCL_DPKG.startswith("Package: libnccl2\nStatus: install ok installed\n")
    assert "\nVersion: 2.28.9-1+cuda13.0\n" in images.NCCL_DPKG


def test_the_probe_finds_the_lab_images_nccl_as_laid_out(tmp_path):
    """The files the lab puts in an image, laid out under a root, read by the real probe."""
    import subprocess
    import sys

    from sparkdeploy.core.packaged import helper

    site, root = tmp_path / "site", tmp_path / "root"
    for rel, data in images.nccl_site_files().items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2.28.9").write_bytes(images.NCCL_FAKE)
    (lib / "libnccl.so.2").symlink_to("libnccl.so.2.28.9")
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(images.NCCL_DPKG.replace("ARCH", "amd64"))
    cp = subprocess.run([sys.executable, "-S", str(helper("probe_image.py")), "--engine", "vllm",
                         "--root", str(root)], capture_output=True, text=True, timeout=60,
                        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    nccl = json.loads(cp.stdout)["nccl"]
    assert (nccl["loads"], nccl["version"]) == ("wheel", "2.28.9")
    assert (nccl["wheel"]["package"], nccl["system"]["version"]) == ("nvidia-nccl-cu13", "2.28.9")
