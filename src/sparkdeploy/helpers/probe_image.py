#!/usr/bin/env python3
"""Probe a Python environment (an image's python3) for serving engines and a model's config.

Standard library only, Python 3.8+ syntax.  Prints one JSON object and exits 0 when it could probe,
2 on bad arguments:

    python3 probe_image.py [--model-dir DIR] [--model-file ENGINE=RELPATH ...]
                           [--min-version ENGINE=VERSION ...] [--require-config ENGINE ...]
                           [--engine ENGINE ...] [--timeout SECONDS]

Package versions come from installed metadata (importlib.metadata over sys.path), model files
from the installed package's directory as the metadata locates it: the engines are never imported
(they need a GPU stack).  The config parse runs ``AutoConfig.from_pretrained(DIR)`` in a child
python3 with a timeout, offline.  An engine is ``ok`` when it is installed, at least its minimum
version, every expected file is present and, for engines named by ``--require-config`` only, the
config parses; ``reasons`` lists every reason it is not.  ``requires`` is what the engine's own
metadata declares of transformers (its version specifier), so a layer can honour it.

``nccl`` says which ``libnccl.so.2`` the image's torch loads, read from files (torch is not
imported, no GPU is needed): the ``nvidia-nccl-cu*`` wheel's (``<site>/nvidia/nccl/lib``) or the
system's ``libnccl2`` (``/usr/lib/<triplet>/libnccl.so.2``), each with its version, and why that
one loads (see ``which_nccl``).
"""

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys

try:
    from importlib import metadata as _metadata
except ImportError:  # pragma: no cover - Python < 3.8
    _metadata = None  # type: ignore[assignment]  # no metadata API: packages read as absent

PACKAGES = ("transformers", "sglang", "vllm", "torch", "ray")
DEFAULT_ENGINES = ("sglang", "vllm")
PARSE_CODE = "import sys\nfrom transformers import AutoConfig\nAutoConfig.from_pretrained(sys.argv[1])\n"

# ---------------------------------------------------------------------------------------------
# PEP 440-ish versions (no `packaging` in arbitrary images)

_VERSION_RE = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>\d+)!)?
    (?P<release>\d+(?:\.\d+)*)
    (?:[-_.]?(?P<pre_l>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>\d+)?)?
    (?:(?:-(?P<post_n1>\d+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d+)?))?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_ORDER = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_NEG = (-1, "")  # sorts before every (0, n)
_POS = (2, "")  # sorts after every (0, n) / (1, n)


def version_key(text):
    """Sort key of a version string; raises ValueError when it is not PEP 440-like."""
    m = _VERSION_RE.match(text or "")
    if not m:
        raise ValueError(f"not a version: {text!r}")
    release = [int(x) for x in m.group("release").split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = None
    if m.group("pre_l"):
        pre = (0, _PRE_ORDER[m.group("pre_l").lower()], int(m.group("pre_n") or 0))
    post = None
    if m.group("post_n1") is not None:
        post = int(m.group("post_n1"))
    elif m.group("post_l"):
        post = int(m.group("post_n2") or 0)
    dev = int(m.group("dev_n") or 0) if m.group("dev_l") else None
    if pre is None and post is None and dev is not None:
        pre_key = (-1, 0, 0)  # 1.0.dev1 < 1.0a1
    elif pre is None:
        pre_key = (1, 0, 0)  # a final release sorts after its pre-releases
    else:
        pre_key = pre
    post_key = (-1,) if post is None else (0, post)
    dev_key = (1,) if dev is None else (0, dev)
    local = m.group("local") or ""
    local_key = tuple(
        (1, int(p), "") if p.isdigit() else (0, 0, p.lower()) for p in re.split(r"[-_.]", local) if p
    )
    return (int(m.group("epoch") or 0), tuple(release), pre_key, post_key, dev_key, local_key)


def compare_versions(a, b):
    """-1, 0 or 1 as version a is below, equal to or above version b."""
    ka, kb = version_key(a), version_key(b)
    # Compare releases padded with zeros (1.0 == 1.0.0).
    ra, rb = list(ka[1]), list(kb[1])
    n = max(len(ra), len(rb))
    ra += [0] * (n - len(ra))
    rb += [0] * (n - len(rb))
    ka = (ka[0], tuple(ra)) + ka[2:]
    kb = (kb[0], tuple(rb)) + kb[2:]
    return (ka > kb) - (ka < kb)


# ---------------------------------------------------------------------------------------------
# installed packages


def _distribution(name):
    if _metadata is None:
        return None
    candidates = [name, name.replace("_", "-"), name.replace("-", "_")]
    for candidate in candidates:
        try:
            return _metadata.distribution(candidate)
        except _metadata.PackageNotFoundError:
            continue
    return None


def package_version(name):
    dist = _distribution(name)
    if dist is None:
        return None
    return dist.metadata["Version"] or dist.version


_REQ_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;()]*)\)?\s*(?:;(.*))?$")


def declared_requirements(name, wanted=("transformers",)):
    """What package NAME's metadata requires of each package in WANTED: its version specifier
    (``"==5.3.0"``, ``""`` for any version); requirements of optional extras are left out."""
    dist = _distribution(name)
    out = {}
    for line in (dist.requires or []) if dist is not None else []:
        m = _REQ_RE.match(line)
        if not m:
            continue
        req, spec, marker = m.group(1), m.group(2).strip(), m.group(3) or ""
        if "extra" in marker:
            continue
        key = req.lower().replace("_", "-")
        if key in wanted:
            out[key] = ",".join(x.strip() for x in spec.split(",") if x.strip())
    return out


def file_present(name, relpath):
    """Whether RELPATH exists in the directory where package NAME's metadata says it is installed."""
    dist = _distribution(name)
    if dist is None:
        return False
    rel = relpath.replace("\\", "/").lstrip("/")
    try:
        located = str(dist.locate_file(rel))
    except Exception:  # noqa: BLE001 - odd distribution finders
        located = ""
    if located and os.path.isfile(located):
        return True
    # RECORD-listed files of an install whose files live elsewhere (e.g. a .pth-based layout).
    for entry in dist.files or ():
        if str(entry).replace("\\", "/") == rel:
            try:
                if os.path.isfile(str(entry.locate())):
                    return True
            except Exception:  # noqa: BLE001
                pass
    return False


# ---------------------------------------------------------------------------------------------
# model config


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::|$)")


def _last_line(text):
    """The last exception line of a traceback (else the last line), one line, bounded."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXC_LINE.match(line):
            return line[:500]
    return lines[-1][:500] if lines else ""


def probe_config(model_dir, timeout):
    result = {"ok": False, "model_type": None, "architectures": None, "error": None}
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        if isinstance(raw, dict):
            result["model_type"] = raw.get("model_type")
            result["architectures"] = raw.get("architectures")
    except (OSError, ValueError) as exc:
        result["error"] = _last_line(f"cannot read {path}: {exc}")
        return result
    if package_version("transformers") is None:
        result["error"] = "transformers is not installed"
        return result
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PARSE_CODE, model_dir],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=timeout,
            text=True,
            errors="replace",
        )
    except subprocess.TimeoutExpired:
        result["error"] = f"config parse timed out after {timeout:g}s"
        return result
    if proc.returncode == 0:
        result["ok"] = True
    else:
        result["error"] = _last_line(proc.stderr) or f"config parse exited {proc.returncode}"
    return result


# ---------------------------------------------------------------------------------------------
# the NCCL torch loads
#
# How torch finds libnccl.so.2, as its wheels are built: libtorch_cuda.so names libnccl.so.2
# (DT_NEEDED) and carries the RPATH $ORIGIN/../../nvidia/nccl/lib, set with patchelf when the
# wheel is built against the PyPI NVIDIA libraries (pytorch .ci/manywheel/build_cuda.sh,
# CUDA_RPATHS); torch/__init__.py's _load_global_deps loads libtorch_global_deps.so with
# RTLD_GLOBAL and, when that fails, preloads each library from <sys.path>/nvidia/<lib>/lib
# (_preload_cuda_deps, 'nccl': 'libnccl.so.*[0-9]').  So the wheel's copy wins whenever the
# nvidia-nccl-cu* wheel is installed beside torch, ahead of LD_LIBRARY_PATH (an RPATH is searched
# before it) and of the system's ld.so.cache; only LD_PRELOAD (loaded before anything) or the
# wheel's file replaced by a link to the system's (the fix of vllm#42354 / #41725 and of
# eugr/spark-vllm-docker's use-official-vllm mod) makes torch load the system's libnccl2.
# Without the wheel, the loader's own order applies: LD_LIBRARY_PATH, then /usr/lib/<triplet>.
# vLLM's own NCCL wrapper opens VLLM_NCCL_SO_PATH when it is set (vllm/envs.py), reported too.

NCCL_SONAME = "libnccl.so.2"
_NCCL_FILE = re.compile(r"libnccl\.so\.2\.(\d+)\.(\d+)$")
_NCCL_WHEEL = re.compile(r"^nvidia-nccl-cu\d+$")


def _real(path):
    return os.path.realpath(path) if os.path.lexists(path) else None


def _file_version(path):
    """The NCCL version in the name the soname link resolves to (libnccl.so.2.28.9 -> 2.28.9)."""
    m = _NCCL_FILE.search(os.path.basename(os.path.realpath(path)))
    return f"2.{m.group(1)}.{m.group(2)}" if m else None


def nccl_wheel():
    """The nvidia-nccl-cu* wheel's library: {package, version, path, real} or None."""
    dists = []
    if _metadata is not None:
        for d in _metadata.distributions():
            name = (d.metadata["Name"] or "").lower().replace("_", "-")
            if _NCCL_WHEEL.match(name):
                dists.append((name, d.metadata["Version"] or d.version))
    for entry in sys.path:
        path = os.path.join(entry or ".", "nvidia", "nccl", "lib", NCCL_SONAME)
        if os.path.lexists(path):
            name, version = dists[0] if dists else (None, None)
            return {"package": name, "version": version or _file_version(path), "path": path,
                    "real": _real(path)}
    return None


def dpkg_version(root, package="libnccl2"):
    """The version dpkg's status file records for PACKAGE (2.28.9-1+cuda13.0 -> 2.28.9)."""
    try:
        with open(os.path.join(root, "var/lib/dpkg/status"), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+):[ \t]*(.*)$", stanza, re.MULTILINE))
        if fields.get("Package") == package and "installed" in fields.get("Status", ""):
            return fields.get("Version", "").split("-", 1)[0] or None
    return None


def nccl_system(root="/"):
    """The system's libnccl2 library: {path, real, version} or None."""
    found = sorted(glob.glob(os.path.join(root, "usr/lib/*", NCCL_SONAME)))
    found += [p for p in (os.path.join(root, "usr/lib", NCCL_SONAME),) if os.path.lexists(p)]
    if not found:
        return None
    path = found[0]
    return {"path": "/" + os.path.relpath(path, root) if root != "/" else path,
            "real": _real(path), "version": dpkg_version(root) or _file_version(path)}


def which_nccl(wheel, system, env, root="/"):
    """(which loads: "wheel", "system", "preload" or None, the path, why) as torch's loading
    order above decides it from the image's files and environment."""
    def inside(p):
        return os.path.join(root, p.lstrip("/")) if root != "/" else p

    sys_real = system["real"] if system else None
    for item in (env.get("LD_PRELOAD") or "").replace(":", " ").split():
        if os.path.basename(item).startswith("libnccl.so"):
            real = _real(inside(item))
            kind = "system" if real and real == sys_real else (
                "wheel" if wheel and real == wheel["real"] else "preload")
            return kind, item, f"LD_PRELOAD names {item}"
    if wheel:
        if sys_real and wheel["real"] == sys_real:
            return "system", wheel["path"], (f"the wheel's {NCCL_SONAME} links to the system's "
                                             f"{system['path']}")
        return "wheel", wheel["path"], ("torch's RPATH $ORIGIN/../../nvidia/nccl/lib finds the "
                                        f"{wheel['package'] or 'nvidia-nccl'} wheel's first")
    for d in (env.get("LD_LIBRARY_PATH") or "").split(":"):
        path = os.path.join(d, NCCL_SONAME) if d else ""
        if path and os.path.lexists(inside(path)):
            real = _real(inside(path))
            kind = "system" if real == sys_real else "preload"
            return kind, path, f"LD_LIBRARY_PATH finds {path}"
    if system:
        return "system", system["path"], "no nvidia-nccl wheel: the loader finds libnccl2's"
    return None, None, "no libnccl.so.2 in the image"


def probe_nccl(env=None, root="/"):
    env = os.environ if env is None else env
    wheel, system = nccl_wheel(), nccl_system(root)
    loads, path, why = which_nccl(wheel, system, env, root)
    version = None
    if loads == "wheel" and wheel:
        version = wheel["version"]
    elif loads == "system" and system:
        version = system["version"]
    elif path:
        version = _file_version(os.path.join(root, path.lstrip("/")) if root != "/" else path)
    out = {"loads": loads, "path": path, "version": version, "why": why,
           "wheel": wheel, "system": system}
    if env.get("VLLM_NCCL_SO_PATH"):
        out["vllm_nccl_so_path"] = env["VLLM_NCCL_SO_PATH"]
    return out


# ---------------------------------------------------------------------------------------------
# command line


def _pair(text):
    engine, sep, value = text.partition("=")
    if not sep or not engine.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected ENGINE=VALUE, got {text!r}")
    return engine.strip(), value.strip()


def _min_version(text):
    engine, value = _pair(text)
    try:
        version_key(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a version: {value!r}") from None
    return engine, value


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="probe_image.py",
        description="Probe this python3 for serving engines and a model's config; print JSON.",
    )
    p.add_argument("--model-dir", metavar="DIR", help="directory holding the model's config.json")
    p.add_argument(
        "--model-file",
        action="append",
        default=[],
        type=_pair,
        metavar="ENGINE=RELPATH",
        help="a file the engine must ship (repeatable)",
    )
    p.add_argument(
        "--min-version",
        action="append",
        default=[],
        type=_min_version,
        metavar="ENGINE=VERSION",
        help="the engine's minimum version (repeatable)",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ENGINE",
        help="also report this engine (repeatable)",
    )
    p.add_argument(
        "--require-config",
        action="append",
        default=[],
        metavar="ENGINE",
        help="this engine needs transformers to parse the config (repeatable)",
    )
    p.add_argument("--root", default="/", help=argparse.SUPPRESS)  # tests: where /usr/lib is
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="limit for the config parse (default 120)",
    )
    args = p.parse_args(argv)
    if args.require_config and not args.model_dir:
        p.error("--require-config needs --model-dir")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    return args


def probe(args):
    engines = []
    for engine, _ in args.model_file + args.min_version:
        if engine not in engines:
            engines.append(engine)
    for engine in args.require_config + args.engine:
        if engine not in engines:
            engines.append(engine)
    if not engines:
        engines = list(DEFAULT_ENGINES)

    names = list(PACKAGES) + [e for e in engines if e not in PACKAGES]
    packages = {name: package_version(name) for name in names}
    config = probe_config(args.model_dir, args.timeout) if args.model_dir else None

    out_engines = {}
    for engine in engines:
        version = packages.get(engine)
        files = {}
        for name, rel in args.model_file:
            if name == engine:
                files[rel] = version is not None and file_present(engine, rel)
        reasons = []
        if version is None:
            reasons.append(f"{engine} is not installed")
        for name, minimum in args.min_version:
            if name != engine or version is None:
                continue
            try:
                if compare_versions(version, minimum) < 0:
                    reasons.append(f"{engine} {version} is below the minimum {minimum}")
            except ValueError:
                reasons.append(f"{engine} version {version!r} cannot be compared with {minimum}")
        for rel, present in files.items():
            if not present and version is not None:
                reasons.append(f"{engine} lacks {rel}")
        if engine in args.require_config and config is not None and not config["ok"]:
            tf = packages.get("transformers")
            if tf is None:
                reasons.append("transformers is not installed: cannot parse the model config")
            else:
                reasons.append(f"transformers {tf} cannot parse model_type {config['model_type']}")
        out_engines[engine] = {
            "installed": version is not None,
            "version": version,
            "model_files": files,
            "requires": declared_requirements(engine) if version is not None else {},
            "ok": not reasons,
            "reasons": reasons,
        }
    return {
        "python": platform.python_version(),
        "arch": platform.machine(),
        "packages": packages,
        "config": config,
        "engines": out_engines,
        "nccl": probe_nccl(root=args.root),
    }


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    json.dump(probe(args), sys.stdout, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
