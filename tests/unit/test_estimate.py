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

from sparkdeploy import estimate as est
from sparkdeploy.fit import GIB
from tests.unit.profiles import ROOT

CONFIGS = Path(__file__).parent / "data" / "configs"
RESERVE = 8 * GIB  # sparkdeploy.config.Fit().reserve_gib


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
    assert e.worst.weights == 100e9 / 3


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
