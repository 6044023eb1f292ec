"""model.estimate: the layout the engines accept and each node's weights + KV cache + reserve
against its usable memory, from real config.json files (tests/unit/data/configs, SOURCES.md).
Every expected number is written out as the formula, from the config's own keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkdeploy.model import estimate as est
from sparkdeploy.model.fit import GIB
from tests.unit.profiles import ROOT

CONFIGS = Path(__file__).parent / "data" / "configs"
RESERVE = 8 * GIB  # sparkdeploy.profile.config.Fit().reserve_gib


def cfg(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


LLAMA = cfg("Llama-3.3-70B-Instruct")
GPT_OSS = cfg("gpt-oss-120b")
QWEN35 = cfg("Qwen3.5-122B-A10B-FP8")
QWEN3 = cfg("Qwen3-235B-A22B-Instruct-2507-FP8")
GLM = cfg("GLM-4.5-Air")
DEEPSEEK = cfg("DeepSeek-R1")


def run(c: dict, **kw):
    kw.setdefault("weights_bytes", 100e9)
    kw.setdefault("memory_gib", 101)
    return est.estimate(c, **kw)


# --- KV cache per token ----------------------------------------------------------------------

def test_dense_gqa_kv_per_token_and_per_rank():
    """Llama-3.3-70B: 80 layers x 2 (K, V) x 8 KV heads x head_dim 128 x 2 bytes (bfloat16)."""
    e = run(LLAMA, nodes=2, context=8192)
    assert e.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2 == 327_680
    assert (e.tp, e.pp) == (2, 1)
    # TP=2: each rank holds 8 / 2 = 4 KV heads of every layer
    assert e.worst.kv == 8192 * 80 * 2 * 4 * 128 * 2
    assert e.worst.weights == 100e9 / 2
    assert e.worst.reserve == RESERVE
    assert e.worst.need == 100e9 / 2 + 8192 * 80 * 2 * 4 * 128 * 2 + RESERVE


def test_sliding_window_layers_hold_at_most_the_window():
    """gpt-oss-120b: 36 layers alternating sliding (window 128) and full; 8 KV heads x 64; no
    dtype in its config, so bfloat16 is assumed."""
    e = run(GPT_OSS, nodes=1, context=131072, seqs=2)
    per_layer = 2 * 8 * 64 * 2
    assert e.kv_bytes_per_token == 18 * per_layer
    assert e.sliding_bytes_per_token == 18 * per_layer
    assert e.worst.kv == 2 * (131072 * 18 * per_layer + 128 * 18 * per_layer)
    assert e.kv_dtype.source.startswith("auto: the model's dtype bfloat16 (no dtype in config")


def test_sliding_window_longer_than_the_context_holds_the_context():
    e = run(GPT_OSS, nodes=1, context=100)
    assert e.worst.kv == 100 * 36 * 2 * 8 * 64 * 2


def test_hybrid_counts_full_layers_per_token_and_linear_state_per_sequence():
    """Qwen3.5-122B-A10B: 12 of 48 layers full attention (2 KV heads x 256), 36 linear
    attention: conv state (4 - 1) x (2 x 16 x 128 + 64 x 128), recurrent 64 x 128 x 128."""
    e = run(QWEN35, nodes=1, context=1000, seqs=3)
    assert e.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    state = ((4 - 1) * (2 * 16 * 128 + 64 * 128) + 64 * 128 * 128) * 2
    assert e.linear_bytes_per_seq == 36 * state == 78_151_680
    assert e.worst.kv == 3 * (1000 * 24_576 + 36 * state)


def test_hybrid_under_tp2_halves_kv_heads_and_linear_state():
    e = run(QWEN35, nodes=2, context=1000)
    state = ((4 - 1) * (2 * 16 * 128 + 64 * 128) + 64 * 128 * 128) * 2
    assert (e.tp, e.pp) == (2, 1)
    assert e.worst.kv == 1000 * 12 * 2 * 1 * 256 * 2 + 36 * state / 2


def test_mla_latent_per_layer_is_whole_on_every_tp_rank():
    """DeepSeek-R1: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per layer, 61 layers,
    shared by the 128 heads and not split by TP."""
    one = run(DEEPSEEK, nodes=1, context=4096)
    four = run(DEEPSEEK, nodes=4, context=4096)
    assert one.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert four.tp == 4
    assert one.worst.kv == four.worst.kv == 4096 * 61 * (512 + 64) * 2


def test_kv_dtype_choices():
    assert run(DEEPSEEK, nodes=1, kv="fp8", context=10).kv_bytes_per_token == 61 * 576 * 1
    assert run(DEEPSEEK, nodes=1, kv="bf16", context=10).kv_bytes_per_token == 61 * 576 * 2
    c = {**LLAMA, "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}
    e = run(c, nodes=1, context=10)
    assert e.kv_dtype.value == 1 and "checkpoint" in e.kv_dtype.source


def test_head_dim_from_hidden_size_when_absent():
    c = {k: v for k, v in LLAMA.items() if k != "head_dim"}
    e = run(c, nodes=1, context=10)
    assert e.model.head_dim == 8192 // 64 == 128
    assert e.model.sources["head_dim"] == "config hidden_size / num_attention_heads"


def test_default_context_is_max_position_embeddings():
    e = run(QWEN3, nodes=4)
    assert e.context.value == 262144
    assert "max_position_embeddings" in e.context.source


# --- layouts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("c, nodes, layout", [
    (LLAMA, 1, (1, 1)), (LLAMA, 2, (2, 1)), (LLAMA, 3, (1, 3)), (LLAMA, 4, (4, 1)),
    (QWEN3, 3, (1, 3)), (QWEN3, 4, (4, 1)), (QWEN3, 8, (8, 1)),
    (GLM, 3, (1, 3)), (GLM, 2, (2, 1)), (GLM, 4, (4, 1)),
    (QWEN35, 3, (1, 3)), (QWEN35, 4, (4, 1)),
    (GPT_OSS, 3, (1, 3)), (GPT_OSS, 4, (4, 1)), (DEEPSEEK, 4, (4, 1)),
])
def test_layout_for_nodes(c, nodes, layout):
    e = run(c, nodes=nodes, context=4096)
    assert (e.tp, e.pp) == layout


def test_tp3_refused_names_the_heads_vllm_52435():
    e = run(QWEN3, nodes=3, context=4096)
    assert e.refused[0] == (
        "TP=3: 64 attention heads do not divide by 3 (vLLM: \"Total number of attention heads "
        "(64) must be divisible by tensor parallel size (3)\", " + est.VLLM_MODEL + ")")


def test_kv_heads_that_neither_divide_nor_are_divided_refuse_tp():
    """GLM-4.5-Air: 96 heads divide by 3, its 8 KV heads do not (nor does 3 divide by 8)."""
    with pytest.raises(est.EstimateError) as e:
        run(GLM, nodes=3, tp=3, context=10)
    assert str(e.value).startswith("TP=3 refused: 8 KV heads neither divide by 3 nor divide it")
    # 16, 24, 32, 48 and 96 are multiples of the 8 KV heads: replicated
    assert str(e.value).endswith("valid TPs: 1, 2, 4, 8, 16, 24, 32, 48, 96")


def test_kv_heads_replicated_when_tp_is_a_multiple():
    """Qwen3-235B: 4 KV heads under TP=8: each rank holds one (vLLM replicates them)."""
    e = run(QWEN3, nodes=8, context=1000)
    assert e.worst.kv == 1000 * 94 * 2 * 1 * 128 * 2


def test_pp_splits_layers_first_stages_one_more():
    """Qwen3-235B's 94 layers over PP=3: 32, 31, 31; the heaviest stage decides."""
    e = run(QWEN3, nodes=3, context=1000)
    assert [s.layers for s in e.stages] == [32, 31, 31]
    assert e.worst.kv == 1000 * 32 * 2 * 4 * 128 * 2
    # the heaviest stage holds 32 of the 94 layers' weights, not the average 100e9 / 3
    assert e.worst.weights == 100e9 * 32 / 94
    assert [s.weights for s in e.stages] == [100e9 * 32 / 94, 100e9 * 31 / 94, 100e9 * 31 / 94]


def test_mixed_tp_pp_when_neither_alone_is_accepted():
    """6 nodes, 4 heads, 4 layers: TP=6 and PP=6 refused; TP=2 x PP=3 chosen over TP=3 x PP=2
    (3 does not divide 4 heads)."""
    c = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256,
         "max_position_embeddings": 100}
    e = run(c, nodes=6)
    assert (e.tp, e.pp) == (2, 3)
    assert e.refused[1] == "PP=6: more stages than the model's 4 layers"


def test_no_layout_is_one_line():
    c = {"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 96,
         "max_position_embeddings": 100}
    with pytest.raises(est.EstimateError, match=r"^no layout for 4 node\(s\): TP=4: 3 attention"):
        run(c, nodes=4)


# --- the verdict -----------------------------------------------------------------------------

def test_fits_and_does_not_fit_with_the_numbers():
    """Llama-3.3-70B in bf16 (141 GB) on one node of 101 GiB: no; on two: yes."""
    one = run(LLAMA, nodes=1, context=8192, weights_bytes=141e9)
    two = run(LLAMA, nodes=2, context=8192, weights_bytes=141e9)
    assert not one.fits and two.fits
    kv1 = 8192 * 80 * 2 * 8 * 128 * 2  # 2.5 GiB
    assert one.worst.need == 141e9 + kv1 + RESERVE
    assert one.why() == ("TP=1 x PP=1 on 1 node(s) does not fit: 141.8 GiB per node (131.3 GiB "
                         "of weights + 2.5 GiB KV cache for 8192 tokens x 1 sequence(s) + 8.0 "
                         "GiB reserve) > 101.0 GiB usable")
    j = two.as_json()
    assert j["fits"] is True and j["layout"] == {"tp": 2, "pp": 1, "nodes": 2}
    assert j["kv_bytes_per_token"] == 327_680
    assert j["per_node_gib"] == round((141e9 / 2 + kv1 / 2 + RESERVE) / GIB, 3)
    assert j["why"] == two.why()


def test_min_nodes_for_the_seed():
    """The seed's 125 GB of FP8 weights need two GB10s at 32k context (FACTS)."""
    e = est.min_nodes(QWEN35, weights_bytes=125e9, memory_gib=101, context=32768)
    assert e is not None and (e.nodes, e.tp) == (2, 2)


# --- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("c, message", [
    ({"model_type": "bert"}, "not a model config: no num_hidden_layers or num_attention_heads"),
    ([1, 2], "not a model config: a JSON list, not an object"),
    ({"num_hidden_layers": 2, "num_attention_heads": 2}, "not a model config: no head_dim or hidden_size"),
    ({"num_hidden_layers": "x", "num_attention_heads": 2}, "num_hidden_layers: 'x' is not a whole number"),
    ({"text_config": {"num_hidden_layers": 2}}, "not a model config: no text_config.num_attention_heads"),
])
def test_not_a_model_config(c, message):
    with pytest.raises(est.EstimateError) as e:
        run(c, nodes=1, context=10)
    assert str(e.value) == message


def test_nodes_below_one():
    with pytest.raises(est.EstimateError, match=r"^--nodes: must be >= 1, not 0$"):
        run(LLAMA, nodes=0, context=10)


# --- combinatorial ---------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(heads=st.integers(1, 128), kv_div=st.integers(1, 16), layers=st.integers(1, 96),
       nodes=st.integers(1, 12))
def test_chosen_layout_is_one_the_engines_accept(heads, kv_div, layers, nodes):
    kv = max(1, heads // kv_div)
    c = {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
         "head_dim": 64, "max_position_embeddings": 64}
    try:
        e = run(c, nodes=nodes)
    except est.EstimateError as err:
        assert str(err).startswith(f"no layout for {nodes} node(s)")
        return
    assert e.tp * e.pp == nodes
    assert heads % e.tp == 0
    assert kv % e.tp == 0 or e.tp % kv == 0
    assert e.pp <= layers
    assert sum(s.layers for s in e.stages) == layers
    assert max(s.layers for s in e.stages) - min(s.layers for s in e.stages) <= 1
    if nodes > 1 and heads % nodes == 0 and (kv % nodes == 0 or nodes % kv == 0):
        assert (e.tp, e.pp) == (nodes, 1)


# --- the task --------------------------------------------------------------------------------

def inv(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "invoke", "model.estimate", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=60)


def test_task_json():
    r = inv("--config", str(CONFIGS / "gpt-oss-120b.json"), "--weights-gb", "65", "--nodes", "2",
            "--memory-gib", "101", "--context", "8192", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["fits"] is True and j["layout"]["tp"] == 2 and j["layout"]["pp"] == 1
    assert j["kv_bytes_per_token"] == 18 * 2 * 8 * 64 * 2
    assert j["sources"]["usable"] == "--memory-gib"


def test_task_does_not_fit_exits_1():
    r = inv("--config", str(CONFIGS / "Qwen3-235B-A22B-Instruct-2507-FP8.json"), "--weights-gb",
            "236", "--nodes", "1")
    assert r.returncode == 1
    assert r.stdout.splitlines()[-1].startswith("TP=1 x PP=1 on 1 node(s) does not fit: ")
    assert f"usable {101.0:.1f} GiB ({est.GB10_SOURCE})" in r.stdout


@pytest.mark.parametrize("args, line", [
    (["--nodes", "0"], "--nodes: must be >= 1, not 0"),
    (["--nodes", "3", "--tp", "3"],
     "model.estimate: TP=3 refused: 64 attention heads do not divide by 3"),
    (["--nodes", "2", "--kv-dtype", "int4"], "--kv-dtype: must be auto or fp8 or bf16, not 'int4'"),
])
def test_task_bad_input_is_one_line_exit_2(args, line):
    r = inv("--config", str(CONFIGS / "Llama-3.3-70B-Instruct.json"), "--weights-gb", "141", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line)
    assert "Traceback" not in r.stderr


def test_task_non_json_and_non_model_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = inv("--config", str(bad), "--weights-gb", "1", "--nodes", "1")
    assert r.returncode == 2 and r.stderr.startswith(f"model.estimate: {bad}: not JSON (")
    bad.write_text('{"architectures": ["BertModel"]}')
    r = inv("--config", str(bad), "--weights-gb", "1", "--nodes", "1")
    assert r.returncode == 2
    assert r.stderr.strip() == ("model.estimate: not a model config: no num_hidden_layers or "
                                "num_attention_heads")


# --- exact figures (each decision and number; docs/notes/mutants.md) ------------------------

SRC = {"layers": "config num_hidden_layers", "heads": "config num_attention_heads",
       "kv_heads": "config num_key_value_heads", "dtype": "config dtype/torch_dtype"}
FULL = "every layer full attention (no layer_types)"
NO_DTYPE = "no dtype in config: bfloat16 assumed"
AUTO_BF16 = ("auto: the model's dtype bfloat16 (no dtype in config: bfloat16 assumed; vLLM's "
             "--kv-cache-dtype auto)")
FIT_RESERVE = "the profile's fit.reserve_gib (sparkdeploy.profile.config.Fit)"
QWEN35_LINEAR = {"key_heads": 16, "value_heads": 64, "key_dim": 128, "value_dim": 128,
                 "conv_kernel": 4}


@pytest.mark.parametrize("c, model", [
    (LLAMA, est.Model(
        model_type="llama", layers=80, heads=64, kv_heads=8, head_dim=128, kinds=("full",) * 80,
        dtype="bfloat16", max_context=131072,
        sources={**SRC, "head_dim": "config head_dim", "kinds": FULL})),
    (GPT_OSS, est.Model(
        model_type="gpt_oss", layers=36, heads=64, kv_heads=8, head_dim=64,
        kinds=("sliding", "full") * 18, window=128, dtype="bfloat16", max_context=131072,
        sources={**SRC, "head_dim": "config head_dim", "kinds": "config layer_types",
                 "window": "config sliding_window", "dtype": NO_DTYPE})),
    (QWEN35, est.Model(
        model_type="qwen3_5_moe", layers=48, heads=32, kv_heads=2, head_dim=256,
        kinds=("linear", "linear", "linear", "full") * 12, linear=QWEN35_LINEAR,
        dtype="bfloat16", max_context=262144,
        sources={"layers": "config text_config.num_hidden_layers",
                 "heads": "config text_config.num_attention_heads",
                 "kv_heads": "config text_config.num_key_value_heads",
                 "head_dim": "config text_config.head_dim",
                 "kinds": "config text_config.layer_types",
                 "linear": f"config text_config.linear_* ({est.VLLM_MAMBA})", "dtype": NO_DTYPE})),
    (DEEPSEEK, est.Model(
        model_type="deepseek_v3", layers=61, heads=128, kv_heads=128, head_dim=7168 // 128,
        kinds=("full",) * 61, mla=(512, 64), dtype="bfloat16", max_context=163840,
        sources={**SRC, "head_dim": "config hidden_size / num_attention_heads",
                 "mla": "config kv_lora_rank + qk_rope_head_dim", "kinds": FULL})),
])
def test_read_config_reads_every_key_with_its_source(c, model):
    assert est.read_config(c) == model


def test_read_config_defaults_and_precedence():
    """No num_key_value_heads: multi-head attention; dtype from the language model's part first;
    model_type from the top, else the language model's, else '?'; MLA without a rope part."""
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}
    m = est.read_config({"llm_config": {**base, "model_type": "inner", "torch_dtype": "float16",
                                        "kv_lora_rank": 32}, "dtype": "float32"})
    assert (m.model_type, m.kv_heads, m.dtype, m.mla) == ("inner", 4, "float16", (32, 0))
    assert m.sources["kv_heads"] == ("config llm_config.num_attention_heads (no "
                                     "num_key_value_heads: multi-head attention)")
    assert m.sources["mla"] == "config llm_config.kv_lora_rank + llm_config.qk_rope_head_dim"
    m = est.read_config({"language_config": {**base, "dtype": "float16", "torch_dtype": "fp8"},
                         "model_type": "outer", "dtype": "float32"})
    assert (m.model_type, m.dtype, m.sources["layers"]) == (
        "outer", "float16", "config language_config.num_hidden_layers")
    m = est.read_config({**base, "dtype": "float32", "torch_dtype": "float16"})
    assert (m.model_type, m.dtype, m.max_context) == ("?", "float32", None)
    assert est.read_config({"text_config": base, "torch_dtype": "fp8"}).dtype == "fp8"
    assert est.read_config({"text_config": base, "dtype": "fp8",
                            "torch_dtype": "float32"}).dtype == "fp8"


@pytest.mark.parametrize("c, message", [
    ({"num_hidden_layers": True, "num_attention_heads": 2},
     "num_hidden_layers: True is not a whole number"),
    ({"text_config": {"num_hidden_layers": 2, "num_attention_heads": -1}},
     "text_config.num_attention_heads: -1 is not a whole number"),
    ({"num_hidden_layers": 2.0, "num_attention_heads": 2}, "num_hidden_layers: 2.0 is not a whole number"),
    ({"num_hidden_layers": 0, "num_attention_heads": 2}, "num_hidden_layers: 0: a model has at least one"),
    ({"num_hidden_layers": 2, "num_attention_heads": 0}, "num_attention_heads: 0: a model has at least one"),
    ({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 0}},
     "text_config.num_key_value_heads: 0: attention has at least one KV head (a config without "
     "the key is multi-head attention)"),
    ({"num_attention_heads": 2, "num_hidden_layers": 2, "head_dim": 0, "hidden_size": 0},
     "not a model config: no head_dim or hidden_size"),
    ({"llm_config": {"num_hidden_layers": 2, "num_attention_heads": 2}},
     "not a model config: no llm_config.head_dim or llm_config.hidden_size"),
    ({**QWEN3, "layer_types": ["full_attention"] * 93},
     "layer_types names 93 layers, num_hidden_layers 94"),
    ({"text_config": {**QWEN35["text_config"], "linear_value_head_dim": None}},
     "linear-attention layers without text_config.linear_value_head_dim"),
    ({**QWEN3, "layer_types": ["sliding_attention"] * 94},
     "sliding-window layers without sliding_window"),
    ({**LLAMA, "torch_dtype": "int4"},
     "config dtype 'int4' is not one of " + ", ".join(sorted(est.DTYPE_BYTES))),
])
def test_config_errors_are_one_line(c, message):
    with pytest.raises(est.EstimateError) as e:
        est.read_config(c)
    assert str(e.value) == message


@pytest.mark.parametrize("keys, kinds, source", [
    ({"layer_types": ["sliding_attention", "linear_attention", "full_attention", "x"],
      "sliding_window": 4096}, ("sliding", "linear", "full", "full"), "config layer_types"),
    ({"layer_types": [], "full_attention_interval": 2}, ("linear", "full", "linear", "full"),
     "config full_attention_interval"),
    ({"full_attention_interval": 3}, ("linear", "linear", "full", "linear"),
     "config full_attention_interval"),
    ({"sliding_window": 4096, "use_sliding_window": True}, ("sliding",) * 4, FULL),
    ({"sliding_window": 4096, "use_sliding_window": False}, ("full",) * 4, FULL),
    ({"sliding_window": None, "use_sliding_window": True}, ("full",) * 4, FULL),
])
def test_layer_kinds(keys, kinds, source):
    """Qwen3.5's language model cut to 4 layers, its layer_types and interval replaced by the
    keys given (Qwen3-235B's use_sliding_window/sliding_window among them)."""
    base = {k: v for k, v in QWEN35["text_config"].items()
            if k not in ("layer_types", "full_attention_interval")}
    m = est.read_config({**base, "num_hidden_layers": 4, **keys})
    assert (m.kinds, m.sources["kinds"]) == (kinds, source)
    assert m.window == (4096 if "sliding" in kinds else None)


@pytest.mark.parametrize("q, kv", [
    ({"kv_cache_quant_algo": "FP8"}, "fp8"), ({"kv_cache_quant_algo": "fp8_e4m3"}, "fp8"),
    ({"kv_cache_quant_algo": "INT8"}, None), ({"kv_cache_quant_algo": 8}, None),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "fp8"),
    ({"kv_cache_scheme": {"num_bits": 4}}, None), ({"kv_cache_scheme": 8}, None),
    (QWEN3["quantization_config"], None), ("fp8", None),
])
def test_checkpoint_kv_cache_dtype(q, kv):
    assert est.read_config({**LLAMA, "quantization_config": q}).checkpoint_kv == kv


def test_kv_dtype_figures():
    llama = est.read_config(LLAMA)
    assert est.kv_dtype(llama, "fp8") == est.Figure(1, "--kv-dtype fp8")
    assert est.kv_dtype(llama, "bf16") == est.Figure(2, "--kv-dtype bf16")
    assert est.kv_dtype(llama, "auto") == est.Figure(2, (
        "auto: the model's dtype bfloat16 (config dtype/torch_dtype; vLLM's --kv-cache-dtype auto)"))
    f32 = est.read_config({**LLAMA, "torch_dtype": "float32"})
    assert est.kv_dtype(f32, "auto").value == 4
    fp8kv = est.read_config({**LLAMA, "quantization_config": {"kv_cache_quant_algo": "FP8"}})
    assert est.kv_dtype(fp8kv, "auto") == est.Figure(
        1, "auto: the checkpoint's quantization_config names an fp8 KV cache")
    assert est.kv_dtype(fp8kv, "bf16").value == 2
    with pytest.raises(est.EstimateError) as e:
        est.kv_dtype(llama, "int4")
    assert str(e.value) == "--kv-dtype: 'int4' is not one of auto, fp8, bf16"


def test_figure_as_json():
    assert est.Figure(2, "x").as_json() == {"value": 2, "source": "x"}


# --- layouts, exactly ------------------------------------------------------------------------

@pytest.mark.parametrize("nodes, order", [
    (1, [(1, 1)]), (2, [(2, 1), (1, 2)]), (3, [(3, 1), (1, 3)]),
    (8, [(8, 1), (1, 8), (4, 2), (2, 4)]),
    (12, [(12, 1), (1, 12), (6, 2), (4, 3), (3, 4), (2, 6)]),
])
def test_candidates_in_order_of_preference(nodes, order):
    assert est.candidates(nodes) == order


def test_stages_and_divisors():
    assert est.stages(94, 3) == [range(0, 32), range(32, 63), range(63, 94)]
    assert est.stages(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert est.divisors(12) == [1, 2, 3, 4, 6, 12]


def test_linear_attention_heads_refuse_tp():
    """Qwen3.5-122B: 16 linear key heads refuse TP=32 though its 32 heads and 2 KV heads allow it;
    with 40 value heads (a variant) TP=16 is refused for them."""
    m = est.read_config(QWEN35)
    assert est.tp_refusal(m, 32) == f"16 linear-attention key heads do not divide by 32 ({est.VLLM_MAMBA})"
    assert est.valid_tps(m) == [1, 2, 4, 8, 16]
    v = est.read_config({"text_config": {**QWEN35["text_config"], "linear_num_value_heads": 40}})
    assert est.tp_refusal(v, 16) == f"40 linear-attention value heads do not divide by 16 ({est.VLLM_MAMBA})"
    assert est.tp_refusal(v, 8) is None


def test_kv_head_refusal_text_and_mla_exemption():
    glm = est.read_config(GLM)
    assert est.tp_refusal(glm, 3) == (
        f"8 KV heads neither divide by 3 nor divide it (vLLM and SGLang QKVParallelLinear: "
        f"{est.VLLM_LINEAR}, {est.SGLANG_LINEAR})")
    assert est.tp_refusal(glm, 16) is None and est.tp_refusal(glm, 4) is None
    # MLA: the latent is not split by heads, so 128 KV heads constrain nothing beyond the heads
    ds = est.read_config({**DEEPSEEK, "num_key_value_heads": 3})
    assert est.tp_refusal(ds, 4) is None
    assert est.layout_refusal(glm, 1, 46) is None
    assert est.layout_refusal(glm, 1, 47) == "PP=47: more stages than the model's 46 layers"
    assert est.layout_refusal(glm, 3, 1).startswith("TP=3: 8 KV heads neither")


def test_refused_layouts_are_listed_in_order():
    assert run(LLAMA, nodes=4, context=10).refused == (
        "TP=1 x PP=4: also accepted, TP=4 x PP=1 preferred",
        "TP=2 x PP=2: also accepted, TP=4 x PP=1 preferred")
    assert run(LLAMA, nodes=1, context=10).refused == ()


def test_forced_tp():
    e = run(LLAMA, nodes=4, tp=2, context=10)
    assert (e.tp, e.pp, e.refused) == (2, 2, ())
    assert (run(LLAMA, nodes=2, tp=1, context=10).tp, run(LLAMA, nodes=2, tp=1, context=10).pp) == (1, 2)
    # PP=4 over 2 layers would leave two nodes without a layer (and halve the weights' share):
    # refused as the automatic choice refuses it
    two = {**LLAMA, "num_hidden_layers": 2}
    with pytest.raises(est.EstimateError) as err:
        run(two, nodes=4, tp=1, context=10)
    assert str(err.value) == ("--tp: 1 on 4 node(s) leaves PP=4: more stages than the model's 2 "
                              "layers")
    assert (run(two, nodes=4, tp=2, context=10).pp, run(two, nodes=2, tp=1, context=10).pp) == (2, 2)
    for tp in (0, 3):
        with pytest.raises(est.EstimateError) as err:
            run(LLAMA, nodes=4, tp=tp, context=10)
        assert str(err.value) == f"--tp: {tp} does not divide the 4 node(s)"
    with pytest.raises(est.EstimateError) as err:
        run(QWEN3, nodes=3, tp=3, context=10)
    assert str(err.value) == (
        f"TP=3 refused: {est.tp_refusal(est.read_config(QWEN3), 3)}; valid TPs: 1, 2, 4, 8, 16, "
        "32, 64")


def test_no_layout_message_whole():
    c = {"num_hidden_layers": 1, "num_attention_heads": 3, "head_dim": 8,
         "max_position_embeddings": 100}
    with pytest.raises(est.EstimateError) as e:
        run(c, nodes=2)
    assert str(e.value) == (
        "no layout for 2 node(s): TP=2: 3 attention heads do not divide by 2 (vLLM: \"Total number "
        f"of attention heads (3) must be divisible by tensor parallel size (2)\", {est.VLLM_MODEL});"
        " PP=2: more stages than the model's 1 layers; valid TPs: 1, 3")


@pytest.mark.parametrize("kw, message", [
    ({"seqs": 0}, "--seqs: must be >= 1, not 0"),
    ({"weights_bytes": 0}, "the weights' size must be > 0, not 0"),
    ({"memory_gib": 0}, "--memory-gib: must be > 0, not 0"),
    ({"context": 0}, "--context: must be >= 1, not 0"),
    ({"kv": "fp4"}, "--kv-dtype: 'fp4' is not one of auto, fp8, bf16"),
])
def test_bad_numbers(kw, message):
    kw = {"context": 10, **kw}
    with pytest.raises(est.EstimateError) as e:
        run(LLAMA, nodes=1, **kw)
    assert str(e.value) == message


def test_no_context_anywhere():
    c = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    with pytest.raises(est.EstimateError) as e:
        run(c, nodes=1)
    assert str(e.value) == "--context: the config names no max_position_embeddings; give one"
    assert run(c, nodes=1, context=1).context == est.Figure(1, "--context")
    assert run(LLAMA, nodes=1).context == est.Figure(
        131072, "config max_position_embeddings (vLLM's default --max-model-len)")


def test_minimum_values_are_accepted():
    e = run(LLAMA, nodes=1, context=1, seqs=1, weights_bytes=1, memory_gib=0.001)
    assert e.worst.need == 1 + 80 * 2 * 8 * 128 * 2 + RESERVE and not e.fits


# --- per node and the JSON -------------------------------------------------------------------

def test_the_heaviest_stage_decides_and_every_stage_must_fit():
    """Qwen3-235B on PP=3 at its 262144 tokens: 32 layers x 0.5 GiB of KV on the first node, 31 on
    the others, and the weights of its layers (32/94, 31/94); 55.4 GiB usable holds the others,
    not the first."""
    per_layer = 262144 * 2 * 4 * 128 * 2
    assert per_layer == GIB // 2
    e = run(QWEN3, nodes=3, memory_gib=55.4, reserve_gib=8, weights_source="hub",
            memory_source="probe")
    w, w31 = 100e9 * 32 / 94, 100e9 * 31 / 94
    assert [s.need for s in e.stages] == [w + 32 * per_layer + RESERVE,
                                          w31 + 31 * per_layer + RESERVE,
                                          w31 + 31 * per_layer + RESERVE]
    assert [s.fits for s in e.stages] == [False, True, True]
    assert e.worst is e.stages[0] and not e.fits
    assert e.as_json() == {
        "fits": False,
        "layout": {"tp": 1, "pp": 3, "nodes": 3},
        "kv_bytes_per_token": 94 * 2 * 4 * 128 * 2,
        "sliding_bytes_per_token": 0,
        "linear_state_bytes_per_sequence": 0,
        "per_node_gib": round((w + 16 * GIB + RESERVE) / GIB, 3),
        "per_node": {"weights_gib": round(w / GIB, 3), "kv_gib": 16.0, "reserve_gib": 8.0,
                     "usable_gib": 55.4, "layers": 32},
        "why": ("TP=1 x PP=3 on 3 node(s) does not fit: 55.7 GiB per node (31.7 GiB of weights + "
                "16.0 GiB KV cache for 262144 tokens x 1 sequence(s) + 8.0 GiB reserve) > 55.4 GiB "
                "usable"),
        "refused": [est.layout_refusal(est.read_config(QWEN3), 3, 1)],
        "sources": {"weights": "hub",
                    "context": "config max_position_embeddings (vLLM's default --max-model-len)",
                    "kv_dtype": ("auto: the model's dtype bfloat16 (config dtype/torch_dtype; "
                                 "vLLM's --kv-cache-dtype auto)"),
                    "reserve": "reserve given", "usable": "probe", **SRC,
                    "head_dim": "config head_dim", "kinds": FULL},
        "inputs": {"weights_bytes": 100e9, "context": 262144, "seqs": 1, "kv_dtype_bytes": 2,
                   "layers": 94, "heads": 64, "kv_heads": 4, "head_dim": 128},
    }


def test_json_of_a_hybrid_model():
    """Qwen3.5 on 4 nodes: TP=4 exceeds its 2 KV heads, so each rank holds one replica; the
    linear state splits by 4; fp8 KV, a given reserve."""
    e = run(QWEN35, nodes=4, context=1000, seqs=2, kv="fp8", reserve_gib=4)
    state = ((4 - 1) * (2 * 16 * 128 + 64 * 128) + 64 * 128 * 128) * 2
    kv = 2 * (1000 * 12 * 2 * 1 * 256 * 1 + 36 * state / 4)
    j = e.as_json()
    assert (j["kv_bytes_per_token"], j["sliding_bytes_per_token"]) == (12 * 2 * 2 * 256, 0)
    assert j["linear_state_bytes_per_sequence"] == 36 * state
    assert j["per_node"] == {"weights_gib": round(25e9 / GIB, 3), "kv_gib": round(kv / GIB, 3),
                             "reserve_gib": 4.0, "usable_gib": 101.0, "layers": 48}
    assert j["per_node_gib"] == round((25e9 + kv + 4 * GIB) / GIB, 3)
    assert j["inputs"]["kv_dtype_bytes"] == 1 and j["sources"]["kv_dtype"] == "--kv-dtype fp8"
    assert j["refused"] == ["TP=1 x PP=4: also accepted, TP=4 x PP=1 preferred",
                            "TP=2 x PP=2: also accepted, TP=4 x PP=1 preferred"]


def test_lines_sliding_model():
    e = run(GPT_OSS, nodes=2, context=8192, seqs=2)
    assert e.lines() == [
        "model: gpt_oss: 36 layers (18 full, 18 sliding; config layer_types), 64 attention heads, "
        "8 KV heads (config num_key_value_heads), head_dim 64 (config head_dim)",
        "layout: TP=2 x PP=1 on 2 node(s)",
        "  not TP=1 x PP=2: also accepted, TP=2 x PP=1 preferred",
        f"KV cache: 36,864 bytes per token in the full-attention layers, 2 byte(s) per element "
        f"({AUTO_BF16})",
        "  sliding-window layers: 36,864 bytes per token, at most 128 tokens per sequence "
        "(config sliding_window)",
        "context: 8192 tokens (--context) x 2 sequence(s)",
        f"per node (36 layers): weights 46.6 GiB (93.1 GiB from --weights-gb / 2), KV cache 0.3 "
        f"GiB, reserve 8.0 GiB ({FIT_RESERVE}), usable 101.0 GiB (--memory-gib)",
        "TP=2 x PP=1 on 2 node(s) fits: 54.9 GiB per node (46.6 GiB of weights + 0.3 GiB KV cache "
        "for 8192 tokens x 2 sequence(s) + 8.0 GiB reserve) <= 101.0 GiB usable",
    ]


def test_lines_hybrid_mla_and_refused():
    lines = run(QWEN35, nodes=3, context=1000).lines()
    assert lines[0] == ("model: qwen3_5_moe: 48 layers (12 full, 36 linear; config "
                        "text_config.layer_types), 32 attention heads, 2 KV heads (config "
                        "text_config.num_key_value_heads), head_dim 256 (config text_config.head_dim)")
    assert lines[1:3] == ["layout: TP=1 x PP=3 on 3 node(s)",
                          "  refused: TP=3: 32 attention heads do not divide by 3 (vLLM: \"Total "
                          "number of attention heads (32) must be divisible by tensor parallel "
                          f"size (3)\", {est.VLLM_MODEL})"]
    assert lines[4] == ("  linear-attention layers: 78,151,680 bytes of state per sequence (config "
                        f"text_config.linear_* ({est.VLLM_MAMBA}))")
    assert lines[5] == "context: 1000 tokens (--context) x 1 sequence(s)"
    assert lines[6].startswith("per node (16 layers): weights 31.0 GiB (93.1 GiB from --weights-gb x "
                               "16/48 layers)")
    ds = run(DEEPSEEK, nodes=1, context=4096, kv="fp8").lines()
    assert ds[:3] == [
        "model: deepseek_v3: 61 layers (61 full; every layer full attention (no layer_types)), "
        "128 attention heads, MLA latent 512 + rope 64 (config kv_lora_rank + qk_rope_head_dim)",
        "layout: TP=1 x PP=1 on 1 node(s)",
        "KV cache: 35,136 bytes per token in the full-attention layers, 1 byte(s) per element "
        "(--kv-dtype fp8)"]
    assert ds[-1].startswith("TP=1 x PP=1 on 1 node(s) does not fit: 101.3 GiB per node")
    assert len(ds) == 6


# --- fewest nodes ----------------------------------------------------------------------------

def test_min_nodes_skips_refused_counts_and_stops_at_most():
    """One layer, 3 heads: 2 nodes have no layout (skipped), 3 nodes take TP=3."""
    c = {"num_hidden_layers": 1, "num_attention_heads": 3, "head_dim": 8,
         "max_position_embeddings": 100}
    e = est.min_nodes(c, weights_bytes=250 * GIB, memory_gib=84, reserve_gib=0)
    assert e is not None and (e.nodes, e.tp, e.pp) == (3, 3, 1)
    assert est.min_nodes(c, weights_bytes=250 * GIB, memory_gib=84, reserve_gib=0, most=2) is None
    # the reserve given reaches every try: 83.3 GiB of weights + 8 GiB does not fit 84 GiB
    assert est.min_nodes(c, weights_bytes=250 * GIB, memory_gib=84, reserve_gib=8, most=3) is None
    one = est.min_nodes(LLAMA, weights_bytes=50e9, memory_gib=101, context=8192)
    assert one is not None and one.nodes == 1
    # 800 GiB: 100 GiB a node on 8 (+ 8 reserve > 101), 88.9 on 9: only past the default 8
    assert est.min_nodes(LLAMA, weights_bytes=800 * GIB, memory_gib=101, context=10) is None
    nine = est.min_nodes(LLAMA, weights_bytes=800 * GIB, memory_gib=101, context=10, most=9)
    assert nine is not None and (nine.nodes, nine.tp, nine.pp) == (9, 1, 9)
    # Llama at 141 GB: one node does not fit, two do; most=1 stops before
    two = est.min_nodes(LLAMA, weights_bytes=141e9, memory_gib=101, context=8192)
    assert two is not None and two.nodes == 2
    assert est.min_nodes(LLAMA, weights_bytes=141e9, memory_gib=101, context=8192, most=1) is None
    big = est.min_nodes(LLAMA, weights_bytes=700 * GIB, memory_gib=101, context=8192)
    assert big is not None and (big.nodes, big.tp) == (8, 8)


@pytest.mark.parametrize("key", [
    "num_key_value_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
    "full_attention_interval", "linear_num_key_heads", "max_position_embeddings",
])
def test_a_bad_number_in_the_language_models_part_names_its_path(key):
    text = {k: v for k, v in QWEN35["text_config"].items() if k != "layer_types"}
    c = {"text_config": {**text, "kv_lora_rank": 512, key: "8"}}
    with pytest.raises(est.EstimateError) as e:
        est.read_config(c)
    assert str(e.value) == f"text_config.{key}: '8' is not a whole number"


def test_bad_hidden_size_and_sliding_window_name_their_path():
    base = {k: v for k, v in QWEN35["text_config"].items() if k != "head_dim"}
    with pytest.raises(est.EstimateError) as e:
        est.read_config({"text_config": {**base, "hidden_size": -2}})
    assert str(e.value) == "text_config.hidden_size: -2 is not a whole number"
    sliding = {**base, "head_dim": 256, "layer_types": ["sliding_attention"] * 48,
               "sliding_window": 1.5}
    with pytest.raises(est.EstimateError) as e:
        est.read_config({"text_config": sliding})
    assert str(e.value) == "text_config.sliding_window: 1.5 is not a whole number"


def test_head_dim_from_hidden_size_is_a_whole_number():
    """hidden_size 100 over 3 heads: head_dim 33 (the floor, as the engines' integer division)."""
    c = {"num_hidden_layers": 1, "num_attention_heads": 3, "hidden_size": 100}
    e = run(c, nodes=1, context=10)
    assert e.model.head_dim == 33
    assert e.kv_bytes_per_token == 2 * 3 * 33 * 2


def test_forced_tp2_refused():
    c = {"num_hidden_layers": 4, "num_attention_heads": 3, "head_dim": 8}
    with pytest.raises(est.EstimateError) as e:
        run(c, nodes=2, tp=2, context=10)
    assert str(e.value).startswith("TP=2 refused: 3 attention heads do not divide by 2")


def test_json_rounds_to_three_places():
    j = run(LLAMA, nodes=1, context=10, reserve_gib=0.12345, memory_gib=100.00049).as_json()
    assert (j["per_node"]["reserve_gib"], j["per_node"]["usable_gib"]) == (0.123, 100.0)


def test_sliding_window_on_every_layer():
    """Qwen3-235B with its use_sliding_window on (window 4096): every layer holds at most 4096
    tokens at a context of 8192; none count per token in the full-attention figure."""
    c = {**QWEN3, "use_sliding_window": True, "sliding_window": 4096}
    e = run(c, nodes=2, context=8192, seqs=3)
    assert (e.kv_bytes_per_token, e.sliding_bytes_per_token) == (0, 94 * 2 * 4 * 128 * 2)
    assert e.worst.kv == 3 * 94 * 4096 * 2 * 2 * 128 * 2
    mixed = {**GPT_OSS, "layer_types": ["full_attention"] * 6 + ["sliding_attention"] * 30}
    e = run(mixed, nodes=1, context=8192)
    assert e.worst.kv == (6 * 8192 + 30 * 128) * 2 * 8 * 64 * 2


def test_load_config(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps(LLAMA))
    assert est.load_config(good) == LLAMA
    with pytest.raises(est.EstimateError) as e:
        est.load_config(tmp_path / "none.json")
    assert str(e.value) == f"{tmp_path / 'none.json'}: No such file or directory"
    good.write_text("\n" * 100000 + "{x")
    with pytest.raises(est.EstimateError) as e:
        est.load_config(good)
    # json's message, first line, cut at 80 characters: "(char 100001)" loses its end
    assert str(e.value) == (f"{good}: not JSON (Expecting property name enclosed in double quotes: "
                            "line 100001 column 2 (char 10)")


# --- the edges (issue 39) --------------------------------------------------------------------

def test_under_pp_the_weights_share_is_the_heaviest_stages_layers():
    """Llama-3.3-70B on 7 nodes: stages of 12 and 11 of its 80 layers; the heaviest holds 12/80
    of 131.4 GiB (19.7), not the average 131.4 / 7 (18.8)."""
    e = run(LLAMA, nodes=7, context=4096, weights_bytes=131.4 * GIB)
    assert (e.tp, e.pp, e.worst.layers) == (1, 7, 12)
    assert e.worst.weights == pytest.approx(131.4 * GIB * 12 / 80)
    assert "weights 19.7 GiB (131.4 GiB from --weights-gb x 12/80 layers)" in e.lines()[-2]


def test_a_lighter_layout_is_chosen_when_the_preferred_does_not_fit_and_named_when_it_does():
    """DeepSeek (MLA: the latent whole on every TP rank) on 8 nodes: TP=8 holds all 61 layers'
    KV cache on every node, PP=8 an eighth of it. Where TP=8 fits it stays preferred and the
    lighter PP=8 is named with why; where it does not and PP=8 does, PP=8 is chosen."""
    roomy = run(DEEPSEEK, nodes=8, context=163840, weights_bytes=100 * GIB, memory_gib=101)
    assert (roomy.tp, roomy.pp) == (8, 1)
    assert roomy.refused[0] == (
        "TP=1 x PP=8: also accepted and lighter (22.5 GiB per node, not 31.2 GiB), TP=8 x PP=1 "
        "preferred: it fits, and tensor parallelism works on each token on every node where "
        "pipeline stages take turns")
    assert "  not " + roomy.refused[0] in roomy.lines()
    tight = run(DEEPSEEK, nodes=8, context=163840, weights_bytes=100 * GIB, memory_gib=25)
    assert (tight.tp, tight.pp) == (1, 8) and tight.fits
    assert "TP=8 x PP=1: also accepted, TP=1 x PP=8 preferred" in tight.refused
    none = run(DEEPSEEK, nodes=8, context=163840, weights_bytes=100 * GIB, memory_gib=20)
    assert (none.tp, none.pp) == (1, 8) and not none.fits
    assert none.refused[0] == ("TP=8 x PP=1: also accepted, TP=1 x PP=8 chosen: neither fits, it "
                               "is the lightest (22.5 GiB per node)")


def test_a_context_longer_than_the_model_is_refused_and_rope_scaling_lengthens_it():
    with pytest.raises(est.EstimateError) as e:
        run(LLAMA, nodes=1, context=131073)
    assert str(e.value) == ("--context: 131073 tokens is more than the model's 131072 (config "
                            "max_position_embeddings): vLLM and SGLang refuse a longer context length")
    assert run(LLAMA, nodes=1, context=131072).context.value == 131072  # llama3 scaling: no longer
    yarn = {**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768}}
    assert est.read_config(yarn).max_context == 262144  # max(262144, 32768 x 4)
    yarn = {**QWEN3, "max_position_embeddings": 32768,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert run(yarn, nodes=4, context=131072).context.value == 131072
    with pytest.raises(est.EstimateError, match=r"more than the model's 131072 \(config "
                       r"max_position_embeddings x rope_scaling.factor\)"):
        run(yarn, nodes=4, context=131073)


def test_a_layout_lighter_by_exactly_the_threshold_is_not_called_lighter():
    """``LIGHTER_GIB`` less per node is the first difference that counts (mutation testing)."""
    def stages(weights: float) -> tuple[est.Stage, ...]:
        return (est.Stage(layers=1, weights=weights, kv=0.0, reserve=0.0, usable=100 * GIB),)

    heavy = 10 * GIB
    chosen, notes = est.choose_layout({(2, 1): stages(heavy), (1, 2): stages(heavy - est.LIGHTER_GIB * GIB)})
    assert chosen == (2, 1) and notes == [f"TP=1 x PP=2: {est.ALSO}, TP=2 x PP=1 preferred"]
    _, notes = est.choose_layout({(2, 1): stages(heavy), (1, 2): stages(heavy - 2 * est.LIGHTER_GIB * GIB)})
    assert "lighter" in notes[0]
