"""The engine stand-ins serve an architecture the image's engine registers and refuse another
with the engine's own words (its registry's ``_raise_for_unsupported``), reading what the engine
registers from its model files as they lie in the image: SGLang's ``srt/models/*.py``
``EntryClass``, vLLM's ``model_executor/models/registry.py`` tables (each module a file)."""

from __future__ import annotations

import json

import pytest

from sparkdeploy.engines import diagnose
from sparkdeploy.lab.standins import engine_server as es

SGLANG_FILES = {
    "qwen3_moe.py": "class Qwen3MoeForCausalLM:\n    pass\n\n\nEntryClass = Qwen3MoeForCausalLM\n",
    "llama.py": "class LlamaForCausalLM:\n    pass\n\n\nclass Phi3ForCausalLM(LlamaForCausalLM):\n"
                "    pass\n\n\nEntryClass = [LlamaForCausalLM, Phi3ForCausalLM]\n",
    "registry.py": "import importlib\n",
    "broken.py": "def (:\n",
}
VLLM_REGISTRY = (
    "_TEXT_GENERATION_MODELS = {\n"
    "    'LlamaForCausalLM': ('llama', 'LlamaForCausalLM'),\n"
    "    'GptOssForCausalLM': ('gpt_oss', 'GptOssForCausalLM'),\n"
    "    'GoneForCausalLM': ('gone', 'GoneForCausalLM'),\n"
    "}\n"
    "_MULTIMODAL_MODELS = {'Qwen3VLForConditionalGeneration': ('qwen3_vl', 'Qwen3VL')}\n"
    "_TRANSFORMERS_BACKEND_MODELS = {'TransformersForCausalLM': ('transformers', 'X')}\n"
    "_PREVIOUSLY_SUPPORTED_MODELS = {'OldForCausalLM': '0.10.2'}\n"
)


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """An image's site-packages holding SGLang's and vLLM's model files as the wheels lay them."""
    site = tmp_path / "site"
    models = site / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    for name, text in SGLANG_FILES.items():
        (models / name).write_text(text)
    vmodels = site / "vllm" / "model_executor" / "models"
    vmodels.mkdir(parents=True)
    (vmodels / "registry.py").write_text(VLLM_REGISTRY)
    for mod in ("llama", "gpt_oss", "qwen3_vl"):
        (vmodels / f"{mod}.py").write_text("")
    (vmodels / "transformers").mkdir()
    (vmodels / "transformers" / "__init__.py").write_text("")  # a module that is a package
    monkeypatch.setenv(es.ENV + "PACKAGES", str(site))
    return site


def model_dir(tmp_path, *archs: str):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": list(archs)}))
    return str(d)


def test_what_each_engine_registers_is_read_from_its_files(packages):
    assert es.supported_archs("sglang") == ["LlamaForCausalLM", "Phi3ForCausalLM",
                                            "Qwen3MoeForCausalLM"]
    # a table entry whose module the image lacks is no architecture it can load
    assert es.supported_archs("vllm") == ["LlamaForCausalLM", "GptOssForCausalLM",
                                          "Qwen3VLForConditionalGeneration",
                                          "TransformersForCausalLM"]


def test_without_the_engine_package_nothing_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(es.ENV + "PACKAGES", str(tmp_path / "empty"))
    assert es.supported_archs("sglang") is None
    assert es.unsupported_arch("vllm", model_dir(tmp_path, "NopeForCausalLM")) is None


def test_a_registered_architecture_passes_and_a_dir_without_config_is_not_judged(packages,
                                                                                 tmp_path):
    assert es.unsupported_arch("sglang", model_dir(tmp_path, "Qwen3MoeForCausalLM")) is None
    assert es.unsupported_arch("vllm", model_dir(tmp_path, "X", "GptOssForCausalLM")) is None
    assert es.unsupported_arch("sglang", str(tmp_path / "none")) is None


def refused(capsys, main, argv: list[str]) -> list[str]:
    """The stand-in's stderr lines as it exits 1 (the engine's exit on this error)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    return capsys.readouterr().err.splitlines()


def test_the_sglang_standin_refuses_as_sglang_does(packages, tmp_path, capsys):
    err = refused(capsys, es.sglang_main,
                  ["--model-path", model_dir(tmp_path, "GptOssForCausalLM"), "--port", "0"])
    assert ("ValueError: Model architectures ['GptOssForCausalLM'] are not supported for now. "
            "Supported architectures: dict_keys(['LlamaForCausalLM', 'Phi3ForCausalLM', "
            "'Qwen3MoeForCausalLM'])") in err
    assert err[-1].endswith("Received sigquit from a child process. It usually means the child "
                            "failed.")
    assert diagnose.classify({"spark1": err}).cls == "model-config-unrecognized"


def test_the_vllm_standin_refuses_as_vllm_0_17_does(packages, tmp_path, capsys):
    path = model_dir(tmp_path, "Qwen3MoeForCausalLM")
    err = refused(capsys, es.vllm_main, ["serve", path, "--port", "0"])
    assert err[-3:] == [
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "  Value error, Model architectures ['Qwen3MoeForCausalLM'] are not supported for now. "
        "Supported architectures: dict_keys(['LlamaForCausalLM', 'GptOssForCausalLM', "
        f"'Qwen3VLForConditionalGeneration', 'TransformersForCausalLM']) [type=value_error, input_value=ArgsKwargs((), "
        f"{{'model': {path!r}}}), input_type=ArgsKwargs]",
        "    For further information visit https://errors.pydantic.dev/2.11/v/value_error"]
    assert diagnose.classify({"spark1": err}).cls == "model-config-unrecognized"
