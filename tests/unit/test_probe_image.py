"""The probe_image.py helper against fake site-packages trees (no engine, no transformers needed)."""

import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from sparkdeploy.core.packaged import helper

SCRIPT = helper("probe_image.py")

# transformers 4.57's message for a model type it does not know (configuration_auto.py).
UNKNOWN_TYPE = (
    "The checkpoint you are trying to load has model type `{t}` but Transformers does not "
    "recognize this architecture. This could be because of an issue with the checkpoint, or "
    "because your version of Transformers is out of date.\n\nYou can update Transformers with the "
    "command `pip install --upgrade transformers`. If this does not work, and the checkpoint is "
    "very new, then there may not be a release version that supports this model yet. In this "
    "case, you can get the most up-to-date code by installing Transformers from source with the "
    "command `pip install git+https://github.com/huggingface/transformers.git`"
)

FAKE_TRANSFORMERS = """
import json, os, time
KNOWN = {known!r}
UNKNOWN_TYPE = {msg!r}

class AutoConfig:
    @classmethod
    def from_pretrained(cls, path):
        if {sleep!r}:
            time.sleep({sleep!r})
        with open(os.path.join(path, "config.json")) as fh:
            cfg = json.load(fh)
        if cfg["model_type"] not in KNOWN:
            raise ValueError(UNKNOWN_TYPE.format(t=cfg["model_type"]))
        return cfg
"""

QWEN = {
    "model_type": "qwen3_5_moe",
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "text_config": {"model_type": "qwen3_5_moe_text"},
}
SGLANG_FILES = ["sglang/srt/models/qwen3_5.py", "sglang/srt/models/qwen3_5_mtp.py"]


def dist(site: Path, name: str, version: str, files: dict[str, str], *, missing=()):
    """A dist-info (METADATA + RECORD) and its files; names in `missing` are listed, not present."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = [f"{rel},," for rel in list(files) + list(missing)]
    record += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    for rel, text in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def fake_transformers(site: Path, version: str, known: list[str], sleep: float = 0):
    code = FAKE_TRANSFORMERS.format(known=known, msg=UNKNOWN_TYPE, sleep=sleep)
    dist(site, "transformers", version, {"transformers/__init__.py": code})


def fake_sglang(site: Path, version: str, *, missing=()):
    files = {"sglang/__init__.py": "raise RuntimeError('the probe must not import engines')\n"}
    for rel in SGLANG_FILES:
        if rel not in missing:
            files[rel] = "# model\n"
    dist(site, "sglang", version, files, missing=missing)


def model_dir(tmp_path: Path, config=QWEN) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def run_probe(site: Path, *args: str) -> subprocess.CompletedProcess:
    # -S: only the fake tree (PYTHONPATH) and the stdlib, not this machine's site-packages.
    return subprocess.run(
        [sys.executable, "-S", str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


def probe_json(site: Path, *args: str) -> dict:
    cp = run_probe(site, *args)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.count("\n") == 1  # one JSON object, one line
    return json.loads(cp.stdout)


SGLANG_ARGS = [
    "--model-file", f"sglang={SGLANG_FILES[0]}",
    "--model-file", f"sglang={SGLANG_FILES[1]}",
    "--min-version", "sglang=0.5.9",
    "--require-config", "sglang",
]  # fmt: skip


def test_seed_image_needs_newer_transformers(tmp_path):
    site = tmp_path / "site"
    fake_transformers(site, "4.57.1", ["qwen3", "qwen3_moe"])
    fake_sglang(site, "0.5.10rc0")
    out = probe_json(site, "--model-dir", model_dir(tmp_path), *SGLANG_ARGS)
    assert out == {
        "python": platform.python_version(),
        "arch": platform.machine(),
        "packages": {
            "transformers": "4.57.1",
            "sglang": "0.5.10rc0",
            "vllm": None,
            "torch": None,
            "ray": None,
        },
        "config": {
            "ok": False,
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "error": "ValueError: The checkpoint you are trying to load has model type "
            "`qwen3_5_moe` but Transformers does not recognize this architecture. This could be "
            "because of an issue with the checkpoint, or because your version of Transformers is "
            "out of date.",
        },
        "engines": {
            "sglang": {
                "installed": True,
                "version": "0.5.10rc0",
                "model_files": {SGLANG_FILES[0]: True, SGLANG_FILES[1]: True},
                "requires": {},
                "ok": False,
                "reasons": ["transformers 4.57.1 cannot parse model_type qwen3_5_moe"],
            }
        },
        "nccl": {"loads": None, "path": None, "version": None, "why": "no libnccl.so.2 in the image",
                 "wheel": None, "system": None},
    }


def test_derivative_image_passes(tmp_path):
    site = tmp_path / "site"
    fake_transformers(site, "5.23.0", ["qwen3_5_moe", "qwen3_5_moe_text"])
    fake_sglang(site, "0.5.10rc0")
    out = probe_json(site, "--model-dir", model_dir(tmp_path), *SGLANG_ARGS)
    assert out["config"] == {
        "ok": True,
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "error": None,
    }
    assert out["engines"]["sglang"]["ok"] is True
    assert out["engines"]["sglang"]["reasons"] == []


def test_old_engine_lists_every_reason(tmp_path):
    """lmsysorg/sglang:spark: SGLang 0.5.4 without the Qwen3.5 files, transformers 4.57."""
    site = tmp_path / "site"
    fake_transformers(site, "4.57.1", ["qwen3"])
    fake_sglang(site, "0.5.4", missing=SGLANG_FILES)
    out = probe_json(site, "--model-dir", model_dir(tmp_path), *SGLANG_ARGS)
    eng = out["engines"]["sglang"]
    assert eng["model_files"] == {SGLANG_FILES[0]: False, SGLANG_FILES[1]: False}
    assert eng["reasons"] == [
        "sglang 0.5.4 is below the minimum 0.5.9",
        f"sglang lacks {SGLANG_FILES[0]}",
        f"sglang lacks {SGLANG_FILES[1]}",
        "transformers 4.57.1 cannot parse model_type qwen3_5_moe",
    ]
    assert eng["ok"] is False


def test_config_rule_only_for_engines_that_require_it(tmp_path):
    """vLLM ships its own Qwen3.5 config classes: a failed transformers parse does not matter."""
    site = tmp_path / "site"
    fake_transformers(site, "4.57.1", ["qwen3"])
    dist(site, "vllm", "0.17.1", {"vllm/model_executor/models/qwen3_5.py": ""})
    out = probe_json(
        site,
        "--model-dir", model_dir(tmp_path),
        "--model-file", "vllm=vllm/model_executor/models/qwen3_5.py",
        "--min-version", "vllm=0.17.0",
    )  # fmt: skip
    assert out["config"]["ok"] is False
    assert out["engines"] == {
        "vllm": {
            "installed": True,
            "version": "0.17.1",
            "model_files": {"vllm/model_executor/models/qwen3_5.py": True},
            "requires": {},
            "ok": True,
            "reasons": [],
        }
    }


def test_engine_not_installed(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    out = probe_json(site, "--model-file", f"sglang={SGLANG_FILES[0]}")
    assert out["config"] is None
    assert out["packages"]["transformers"] is None
    assert out["engines"]["sglang"] == {
        "installed": False,
        "version": None,
        "model_files": {SGLANG_FILES[0]: False},
        "requires": {},
        "ok": False,
        "reasons": ["sglang is not installed"],
    }


def test_file_listed_in_record_but_deleted_is_missing(tmp_path):
    site = tmp_path / "site"
    fake_sglang(site, "0.5.10rc0")
    (site / SGLANG_FILES[1]).unlink()
    out = probe_json(site, "--model-file", f"sglang={SGLANG_FILES[1]}")
    assert out["engines"]["sglang"]["model_files"] == {SGLANG_FILES[1]: False}
    assert out["engines"]["sglang"]["reasons"] == [f"sglang lacks {SGLANG_FILES[1]}"]


def test_no_engine_named_reports_the_known_engines(tmp_path):
    site = tmp_path / "site"
    fake_sglang(site, "0.5.10rc0")
    out = probe_json(site)
    assert sorted(out["engines"]) == ["sglang", "vllm"]
    assert out["engines"]["sglang"]["ok"] is True
    assert out["engines"]["vllm"]["reasons"] == ["vllm is not installed"]


def test_transformers_missing_means_no_parse(tmp_path):
    site = tmp_path / "site"
    fake_sglang(site, "0.5.10rc0")
    out = probe_json(site, "--model-dir", model_dir(tmp_path), "--require-config", "sglang")
    assert out["config"]["ok"] is False
    assert out["config"]["error"] == "transformers is not installed"
    assert out["engines"]["sglang"]["reasons"] == [
        "transformers is not installed: cannot parse the model config"
    ]


def test_unreadable_config(tmp_path):
    site = tmp_path / "site"
    fake_transformers(site, "5.23.0", ["qwen3_5_moe"])
    empty = tmp_path / "empty"
    empty.mkdir()
    out = probe_json(site, "--model-dir", empty)
    assert out["config"]["ok"] is False
    assert out["config"]["model_type"] is None
    assert out["config"]["error"].startswith(f"cannot read {empty}/config.json")


def test_config_parse_timeout(tmp_path):
    site = tmp_path / "site"
    fake_transformers(site, "5.23.0", ["qwen3_5_moe"], sleep=30)
    out = probe_json(site, "--model-dir", model_dir(tmp_path), "--timeout", "0.5")
    assert out["config"]["ok"] is False
    assert out["config"]["error"] == "config parse timed out after 0.5s"


@pytest.mark.parametrize(
    "args",
    [
        ["--bogus"],
        ["--model-file", "sglang"],
        ["--model-file", "=x.py"],
        ["--min-version", "sglang=not-a-version"],
        ["--require-config", "sglang"],  # nothing to parse without --model-dir
        ["--timeout", "0", "--model-dir", "/nonexistent"],
    ],
)
def test_bad_arguments_exit_2_with_usage(tmp_path, args):
    cp = run_probe(tmp_path, *args)
    assert cp.returncode == 2
    assert cp.stdout == ""
    assert cp.stderr.startswith("usage: probe_image.py")


# -- the version comparator ------------------------------------------------------------------


def _load():
    spec = importlib.util.spec_from_file_location("probe_image", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "low,high",
    [
        ("0.5.9", "0.5.10rc0"),
        ("0.5.10rc0", "0.5.10"),
        ("0.5.10.dev3", "0.5.10a1"),
        ("0.5.10a1", "0.5.10b1"),
        ("0.5.10b2", "0.5.10rc1"),
        ("0.5.10rc1.dev1", "0.5.10rc1"),
        ("0.5.10", "0.5.10.post1"),
        ("0.5.10.post1.dev1", "0.5.10.post1"),
        ("4.57.1", "5.2.0"),
        ("5.2.0", "5.23.0"),
        ("1.0", "1!0.1"),
        ("2.9.0", "2.9.0+cu130"),
    ],
)
def test_version_order(low, high):
    cmp = _load().compare_versions
    assert cmp(low, high) == -1
    assert cmp(high, low) == 1


@pytest.mark.parametrize("a,b", [("1.0", "1.0.0"), ("0.5.10rc0", "0.5.10-rc0"), ("5.2", "5.2.0")])
def test_version_equal(a, b):
    assert _load().compare_versions(a, b) == 0


def test_version_rejects_garbage():
    with pytest.raises(ValueError):
        _load().version_key("latest")


def test_reports_what_the_engine_declares_of_transformers(tmp_path):
    site = tmp_path / "site"
    fake_sglang(site, "0.5.10rc0")
    meta = site / "sglang-0.5.10rc0.dist-info" / "METADATA"
    meta.write_text(meta.read_text() + "Requires-Dist: aiohttp\n"
                    "Requires-Dist: transformers==5.3.0\n"
                    "Requires-Dist: transformers<4; extra == \"legacy\"\n")
    out = probe_json(site, "--engine", "sglang")
    assert out["engines"]["sglang"]["requires"] == {"transformers": "==5.3.0"}


@pytest.mark.parametrize("line,want", [
    ("transformers==5.3.0", "==5.3.0"),
    ("transformers (>=4.51, <5)", ">=4.51,<5"),
    ("Transformers[torch] >=5 ; python_version >= '3.8'", ">=5"),
    ("transformers", ""),
    ("transformers>=4; extra == 'dev'", None),
    ("transformers-stream-generator==0.0.5", None),
])
def test_declared_requirement_forms(monkeypatch, line, want):
    spec = importlib.util.spec_from_file_location("probe_image", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Dist:
        requires = [line]

    monkeypatch.setattr(mod, "_distribution", lambda name: Dist)
    got = mod.declared_requirements("sglang")
    assert got == ({} if want is None else {"transformers": want})


# --- the NCCL torch loads (files only: the wheel's lib, libnccl2's, the image's environment) ---

WHEEL_LIB = "nvidia/nccl/lib/libnccl.so.2"
TRIPLET = "usr/lib/aarch64-linux-gnu"
DPKG = ("Package: libnccl-dev\nStatus: install ok installed\nVersion: 2.27.7-1+cuda13.0\n\n"
        "Package: libnccl2\nStatus: install ok installed\nVersion: 2.27.7-1+cuda13.0\n"
        "Architecture: arm64\n")


def nccl_wheel(site: Path, version="2.28.9", cuda="13"):
    dist(site, f"nvidia_nccl_cu{cuda}", version, {WHEEL_LIB: "fake so\n"})
    # the wheel's METADATA names the distribution as pip lists it
    meta = site / f"nvidia_nccl_cu{cuda}-{version}.dist-info" / "METADATA"
    meta.write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu{cuda}\nVersion: {version}\n")


def libnccl2(root: Path, version="2.27.7", dpkg=True):
    lib = root / TRIPLET
    lib.mkdir(parents=True, exist_ok=True)
    (lib / f"libnccl.so.{version}").write_text("fake so\n")
    (lib / "libnccl.so.2").symlink_to(f"libnccl.so.{version}")
    if dpkg:
        (root / "var/lib/dpkg").mkdir(parents=True, exist_ok=True)
        (root / "var/lib/dpkg/status").write_text(DPKG.replace("2.27.7", version))


def both_nccls(tmp_path: Path) -> tuple[Path, Path]:
    """An image with the wheel's NCCL (2.28.9) in ``site`` and libnccl2 (2.27.7) under ``root``."""
    site, root = tmp_path / "site", tmp_path / "root"
    nccl_wheel(site)
    libnccl2(root)
    return site, root


def nccl_of(tmp_path: Path, site: Path, **env: str) -> dict:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    cp = subprocess.run([sys.executable, "-S", str(SCRIPT), "--engine", "sglang", "--root", str(root)],
                        capture_output=True, text=True, timeout=60,
                        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", **env})
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)["nccl"]


def test_the_wheel_wins_over_libnccl2_and_both_versions_are_reported(tmp_path):
    site, _ = both_nccls(tmp_path)
    got = nccl_of(tmp_path, site)
    assert (got["loads"], got["version"], got["path"]) == ("wheel", "2.28.9", str(site / WHEEL_LIB))
    assert got["wheel"]["package"] == "nvidia-nccl-cu13" and got["wheel"]["version"] == "2.28.9"
    assert got["system"]["path"] == "/usr/lib/aarch64-linux-gnu/libnccl.so.2"
    assert got["system"]["version"] == "2.27.7"  # from dpkg's status, not libnccl-dev's stanza
    assert got["why"] == ("torch's RPATH $ORIGIN/../../nvidia/nccl/lib finds the nvidia-nccl-cu13 "
                          "wheel's first")


def test_ld_library_path_does_not_beat_the_wheel(tmp_path):
    site, _ = both_nccls(tmp_path)
    got = nccl_of(tmp_path, site, LD_LIBRARY_PATH="/usr/lib/aarch64-linux-gnu")
    assert got["loads"] == "wheel"


def test_the_wheels_lib_linked_to_libnccl2_loads_the_system_nccl(tmp_path):
    site, root = both_nccls(tmp_path)
    wheel_lib = site / WHEEL_LIB
    wheel_lib.rename(wheel_lib.with_name("libnccl.so.2.sparkdeploy-wheel"))
    wheel_lib.symlink_to(root / TRIPLET / "libnccl.so.2")
    got = nccl_of(tmp_path, site)
    assert (got["loads"], got["version"]) == ("system", "2.27.7")
    assert got["wheel"]["version"] == "2.28.9"  # still installed: both versions reported
    assert got["why"] == ("the wheel's libnccl.so.2 links to the system's "
                          "/usr/lib/aarch64-linux-gnu/libnccl.so.2")


def test_ld_preload_of_libnccl2_wins(tmp_path):
    site, _ = both_nccls(tmp_path)
    got = nccl_of(tmp_path, site, LD_PRELOAD="/usr/lib/aarch64-linux-gnu/libnccl.so.2")
    assert (got["loads"], got["version"]) == ("system", "2.27.7")
    assert got["why"] == "LD_PRELOAD names /usr/lib/aarch64-linux-gnu/libnccl.so.2"


def test_without_the_wheel_the_system_nccl_loads_version_from_the_file_name(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    libnccl2(tmp_path / "root", "2.26.2", dpkg=False)
    got = nccl_of(tmp_path, site, VLLM_NCCL_SO_PATH="/opt/nccl/libnccl.so.2")
    assert (got["loads"], got["version"], got["wheel"]) == ("system", "2.26.2", None)
    assert got["vllm_nccl_so_path"] == "/opt/nccl/libnccl.so.2"


def test_the_wheel_alone(tmp_path):
    site = tmp_path / "site"
    nccl_wheel(site, "2.27.3", cuda="12")
    got = nccl_of(tmp_path, site)
    assert (got["loads"], got["version"], got["system"]) == ("wheel", "2.27.3", None)
