"""The real argument parser of a serving engine, read without a GPU: every option it accepts.

Run by ``nox -s engine_flags`` (``tools.flagmaker``) with the python of a scratch
virtualenv that holds the engine's wheel; on no node. Standard library and the engine only::

    python engine_flags.py sglang
    python engine_flags.py vllm

The engine builds its own parser the way its server entry point does, and the parser is caught
where that entry point would parse the command line (``argparse.ArgumentParser.parse_args``):

- SGLang: ``sglang.srt.server_args.prepare_server_args([])`` (what ``python3 -m
  sglang.launch_server`` calls: ``ServerArgs.add_cli_args`` on its parser);
- vLLM: ``vllm.entrypoints.cli.main.main()`` with ``vllm serve`` (the ``serve`` subcommand's
  parser: ``make_arg_parser``, which holds ``AsyncEngineArgs.add_cli_args``).

What cannot be imported without a GPU stack is faked (``FAKED``, and with ``--fake-missing``
every missing non-standard package): a fake imports, has every attribute, can be called,
subclassed and used as a decorator. Fakes stay absent to the checks that ask whether a package
is installed (``importlib.util.find_spec`` answers None, ``importlib.metadata`` knows no
distribution of them), and never stand for a standard-library module. vLLM's platform is forced
to its CPU platform (``--platform cpu``): without a GPU it cannot infer its device.

The answer (the last line of stdout) is the parser: its prog, ``allow_abbrev``, and each option
with every option string (aliases and ``--no-`` forms), its ``dest``, whether it takes a value,
its ``nargs`` and ``choices``.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import traceback
import types

try:  # in the package (the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

    # the engine's imports must not find this directory's modules
    sys.path[:] = [p for p in sys.path if p not in (_here, os.path.dirname(_here))]

FAKED = {
    # the GPU stack and compiled kernels: never installed in the scratch virtualenv
    "sglang": ("torch", "triton", "torchvision", "torchaudio", "flashinfer", "sgl_kernel",
               "sglang_kernel", "cuda", "pynvml", "xgrammar", "outlines", "vllm", "decord",
               "deep_gemm", "torchao"),
    "vllm": ("torch", "triton", "torchvision", "torchaudio", "xformers", "flashinfer",
             "vllm._C", "vllm._moe_C", "vllm._rocm_C", "vllm.cumem_allocator",
             "vllm.vllm_flash_attn", "vllm._flashmla_C", "vllm._flashmla_extension_C",
             "pynvml", "cuda", "xgrammar", "outlines_core", "llguidance", "cupy",
             "deep_gemm", "deep_ep", "torchao", "numba", "cv2", "compressed_tensors",
             "vllm_flash_attn", "flash_attn", "mistral_common", "ray"),
}


class _Zero:
    """What a fake is as a number or in a comparison: zero, and never less or more."""

    def __int__(self):
        return 0

    __index__ = __int__

    def __float__(self):
        return 0.0

    def __lt__(self, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__


class _FakeMeta(_Zero, abc.ABCMeta):
    """The type of every fake attribute: anything read from it is another fake, calling it on a
    single function gives the function back (a decorator), any other call gives a fake."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _fake(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if not cls.__dict__.get("_is_fake"):
            return super().__call__(*args, **kwargs)
        return _called(args, kwargs)

    def register(cls, *args, **kwargs):  # ABCMeta's own, and a fake's (AutoConfig.register(a, b))
        return args[0] if args else None

    def __getitem__(cls, item):
        return cls

    def __setitem__(cls, item, value) -> None:
        return None

    def __contains__(cls, item) -> bool:
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0

    def __bool__(cls):
        return False

    def __enter__(cls):
        return cls

    def __exit__(cls, *exc):
        return False

    def __hash__(cls):
        return id(cls)

    def __eq__(cls, other):
        return cls is other


class _Value(_Zero, str):
    """What calling a fake gives: an empty (false) string whose attributes are more of them,
    callable in turn (a value used as a name, a flag or a decorator still works)."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Value()

    def __call__(self, *args, **kwargs):
        return _called(args, kwargs)

    def __getitem__(self, item):
        return _Value()

    def __iter__(self):
        return iter(())

    def __hash__(self):
        return 0

    def __mul__(self, other):
        return _Value()

    __rmul__ = __truediv__ = __rtruediv__ = __sub__ = __rsub__ = __floordiv__ = __pow__ = __mul__
    __neg__ = __abs__ = __mul__


def _called(args, kwargs):
    """A fake called: on one function (a decorator), the function; else a ``_Value``."""
    if len(args) == 1 and not kwargs and isinstance(args[0], types.FunctionType):
        return args[0]
    return _Value()


def _subclassed(cls, **kwargs) -> None:
    """A fake's subclass may take class keywords (``class K(Base, total=False)``)."""


def _fake(name: str) -> type:
    return _FakeMeta(name.rpartition(".")[2] or name, (), {
        "_is_fake": True, "__qualname__": name, "__module__": name.rpartition(".")[0],
        "__init_subclass__": classmethod(_subclassed)})


ABSENT = {"torch": ("npu", "hpu", "musa", "mlu")}
"""Attributes a fake lacks, as the real package does (only a vendor's plugin adds them: an
engine's ``hasattr(torch, "npu")`` must say no)."""


def _int_info(dtype=None):
    return types.SimpleNamespace(min=-(2**63), max=2**63 - 1, bits=64)


def _float_info(dtype=None):
    return types.SimpleNamespace(min=-3.4e38, max=3.4e38, eps=1.2e-7, tiny=1.2e-38, bits=32)


REAL = {"torch": {"iinfo": _int_info, "finfo": _float_info}}
"""Attributes of a fake that must be real values (bounds that a pydantic model of the engine
takes as its fields' limits: ``torch.iinfo(torch.long).max``)."""


class _FakeModule(types.ModuleType):
    def __getattr__(self, name: str):
        if (name.startswith("__") and name.endswith("__")) or name in ABSENT.get(self.__name__, ()):
            raise AttributeError(name)
        if name in REAL.get(self.__name__, {}):
            return REAL[self.__name__][name]
        value = _fake(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


PINNED: dict = {}
"""Top-level name -> the version the engine pins (``name==version`` in its metadata): a fake's
``__version__``, so version checks take the branch the real install takes."""


class _FakeLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _FakeModule(spec.name)
        mod.__path__ = []  # a package: its submodules are fakes too
        mod.__version__ = PINNED.get(spec.name.partition(".")[0], "0.0.0")
        return mod

    def exec_module(self, module) -> None:
        return None


class Fakes(importlib.abc.MetaPathFinder):
    """Fakes for ``names`` (top-level packages or dotted modules); with ``missing``, for every
    module no other finder finds (this finder is asked last) that is not the standard
    library's."""

    def __init__(self, names, missing: bool = False):
        self.names = tuple(names)
        self.missing = missing
        self.made: set[str] = set()

    def covers(self, name: str) -> bool:
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names:
            return False
        return any(name == n or name.startswith(n + ".") for n in self.names) or (
            self.missing and top in self.made)

    def find_spec(self, name, path=None, target=None):
        if not self.covers(name) and not (self.missing and "." not in name
                                          and name not in sys.stdlib_module_names):
            return None
        self.made.add(name.partition(".")[0])
        return importlib.machinery.ModuleSpec(name, _FakeLoader(), is_package=True)


class _Listed(Fakes):
    """Asked first: the named fakes win over a real package of the same name (a compiled part
    of the engine that is in the wheel but cannot load)."""

    def find_spec(self, name, path=None, target=None):
        if not any(name == n or name.startswith(n + ".") for n in self.names):
            return None
        return importlib.machinery.ModuleSpec(name, _FakeLoader(), is_package=True)


def read_pins(engine: str) -> dict:
    """``{module: version}`` of the ``name==version`` requirements the engine's metadata
    declares without a marker (``torch==2.9.1`` -> ``{"torch": "2.9.1"}``)."""
    from importlib import metadata

    pins = {}
    for req in metadata.requires(engine) or []:
        head = req.split(";", 1)[0].strip()
        if ";" in req or "==" not in head:
            continue
        name, _, version = head.partition("==")
        module = name.strip().split("[", 1)[0].lower().replace("-", "_")
        pins[module] = version.strip().split(",", 1)[0]
    return pins


def install_fakes(names, missing: bool = False) -> Fakes:
    """Put the fakes in place: the listed ones first on ``sys.meta_path``, the missing ones last;
    ``importlib.util.find_spec`` says None for every fake (it looks not installed)."""
    listed = _Listed(names)
    last = Fakes(names, missing)
    sys.meta_path.insert(0, listed)
    sys.meta_path.append(last)
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        full = importlib.util.resolve_name(name, package) if name.startswith(".") else name
        if listed.find_spec(full) is not None or last.covers(full):
            return None
        try:
            spec = real_find_spec(name, package)
        except ValueError:  # a fake in sys.modules (its spec is gone): not installed
            return None
        return None if spec is not None and isinstance(spec.loader, _FakeLoader) else spec

    importlib.util.find_spec = find_spec
    return last


# --- catching the parser ------------------------------------------------------------------


class Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def catch_parser(build) -> argparse.ArgumentParser:
    """The parser ``build()`` makes, caught where it would parse (``parse_args`` or
    ``parse_known_args``)."""
    saved = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args

    def caught(self, *args, **kwargs):
        raise Caught(self)

    argparse.ArgumentParser.parse_known_args = caught  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_args = caught  # type: ignore[method-assign]
    try:
        build()
    except Caught as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args = saved  # type: ignore[method-assign]
    raise RuntimeError("the engine built no parser")


def sglang_parser() -> argparse.ArgumentParser:
    server_args = importlib.import_module("sglang.srt.server_args")
    # the prog of a parser without one: what `python3 -m sglang.launch_server` makes it
    sys.argv = [os.path.join(os.path.dirname(str(server_args.__file__)), "..", "launch_server.py")]
    return catch_parser(lambda: server_args.prepare_server_args([]))


def vllm_parser(platform: str) -> argparse.ArgumentParser:
    force_vllm_platform(platform)
    sys.argv = ["vllm", "serve"]
    main = importlib.import_module("vllm.entrypoints.cli.main")
    top = catch_parser(main.main)
    return subparser(top, "serve")


def force_vllm_platform(platform: str) -> None:
    """vLLM's ``current_platform`` set to its ``platform`` platform class before anything asks
    (without a GPU, vLLM cannot infer its device)."""
    platforms = importlib.import_module("vllm.platforms")
    names = {"cpu": ("vllm.platforms.cpu", "CpuPlatform"),
             "cuda": ("vllm.platforms.cuda", "CudaPlatform")}
    mod, cls = names[platform]
    platform_class = getattr(importlib.import_module(mod), cls)
    setattr(platforms, "_current_platform", platform_class())  # noqa: B010 - vLLM's private global


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise RuntimeError(f"the parser {parser.prog!r} has no subcommand {name!r}")


# --- the answer -------------------------------------------------------------------------


def _plain(value):
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def describe(parser: argparse.ArgumentParser) -> dict:
    """The parser as data: prog, ``allow_abbrev``, options (every option string), positionals."""
    options, positionals = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        takes = action.nargs != 0
        entry = {
            "dest": action.dest,
            "nargs": action.nargs if action.nargs is None or isinstance(action.nargs, int)
            else str(action.nargs),
            "takes_value": takes,
            "choices": (None if action.choices is None else
                        sorted(map(_plain, action.choices), key=str)  # a set: one order
                        if isinstance(action.choices, (set, frozenset))
                        else [_plain(c) for c in action.choices]),
            "action": type(action).__name__,
        }
        if action.option_strings:
            options.append({"flags": list(action.option_strings), **entry})
        else:
            positionals.append(entry)
    return {"prog": parser.prog, "allow_abbrev": parser.allow_abbrev, "options": options,
            "positionals": positionals, "parser_class": type(parser).__name__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="engine_flags.py")
    p.add_argument("engine", choices=sorted(FAKED))
    p.add_argument("--fake", action="append", default=[], help="also fake this module")
    p.add_argument("--fake-missing", action="store_true",
                   help="fake every module that is not installed (not the standard library's)")
    p.add_argument("--platform", default="cpu", choices=("cpu", "cuda"),
                   help="vLLM's platform, forced")
    ns = p.parse_args(argv)
    PINNED.update(read_pins(ns.engine))
    install_fakes([*FAKED[ns.engine], *ns.fake], ns.fake_missing)
    os.environ.setdefault("VLLM_TARGET_DEVICE", ns.platform)
    try:
        parser = sglang_parser() if ns.engine == "sglang" else vllm_parser(ns.platform)
    except Exception as e:  # noqa: BLE001 - one line: which import or call failed
        traceback.print_exc()  # the log: where it failed
        return protocol.fail(f"{ns.engine}: cannot build its parser: {type(e).__name__}: {e}")
    protocol.answer(describe(parser))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
