"""model.fit: the weights' share of each node plus the engine's reserve against the memory the
node reports, and the engine's memory fraction against what the node can give. Figures from
outputs recorded on a real DGX Spark (GB10: nvidia-smi's [N/A], /proc/meminfo) and discrete GPUs
(tests/unit/data/memory), lines asserted exactly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.records import HubMetadata
from sparkdeploy.helpers import memory_node as mn
from sparkdeploy.model import fit
from sparkdeploy.model.estimate import EstimateError
from sparkdeploy.node.memory import NodeMemory
from sparkdeploy.ops.model import cache_name
from sparkdeploy.ops.model_fit import size
from sparkdeploy.profile.config import load_profile, read_recipe
from sparkdeploy.steps import model_fit, registry
from tests.unit.fakes import FakeContext, deployment
from tests.unit.profiles import SEED, seed_data, write_profile

DATA = Path(__file__).parent / "data" / "memory"
MIB = 1024 * 1024
KIB = 1024
GIB = 1024 ** 3
SEED_WEIGHTS = 125_000_000_000  # the seed model's FP8 weights, about 125 GB on the hub


def gb10(meminfo: str | None = None) -> dict:
    """The memory helper's answer on a GB10: nvidia-smi's [N/A] row, and the recorded
    /proc/meminfo (or ``meminfo``)."""
    text = meminfo if meminfo is not None else (DATA / "gb10-meminfo.txt").read_text()
    rows = mn.parse_gpus("0, NVIDIA GB10, [N/A], [N/A]\n", mn.QUERY)
    return mn.judge(rows, mn.parse_meminfo(text))


def seed_sized(answer: dict, engine: int = 0, reserve: float = 8.0, **changes):
    """Seed engine ``engine`` (its fields changed by ``changes``) sized by the fit calculator on
    the seed recipe's config.json, on a node that answered ``answer``."""
    e = load_profile(SEED).engines[engine].model_copy(update=changes)
    m = NodeMemory.model_validate(answer)
    return size(seed_config(), e, node="spark2", gpus=1, weights=SEED_WEIGHTS,
                reserve_gib=reserve, gpu_usable=m.gpu_usable, gpu_total=m.gpu_total,
                memory_source=m.source)


def seed_check(answer: dict, engine: int = 0, reserve: float = 8.0):
    return seed_sized(answer, engine, reserve).check


def seed_config() -> dict:
    return read_recipe(load_profile(SEED).recipe).config()


# --- the arithmetic on recorded figures --------------------------------------------------------

def test_seed_on_a_recorded_gb10_fits():
    c = seed_check(gb10())
    assert c.fits
    assert c.line() == ("spark2: sglang fits: 66.6 GiB needed (58.2 GiB of weights + 0.4 GiB KV "
                        "cache for 32768 tokens x 1 sequence(s) + 8.0 GiB reserve), "
                        "--mem-fraction-static 0.85 x 121.7 GiB = 103.4 GiB; 113.1 GiB "
                        "usable of 121.7 GiB")


def test_gb10_whose_memory_is_held_refuses_with_both_numbers():
    # the recorded MemTotal; MemAvailable as left by an engine still holding 60 GiB
    held = "MemTotal:       127600748 kB\nMemAvailable:   55000000 kB\n"
    c = seed_check(gb10(held))
    assert not c.fits
    assert c.line() == ("spark2: sglang does not fit: 66.6 GiB needed (58.2 GiB of weights + "
                        "0.4 GiB KV cache for 32768 tokens x 1 sequence(s) + 8.0 GiB reserve) > "
                        "52.5 GiB usable; --mem-fraction-static 0.85 x 121.7 GiB = 103.4 GiB > "
                        "52.5 GiB usable")


def test_a_fraction_near_09_asks_more_than_a_gb10_gives():
    # usable near 101-102 of 121.7 GiB: 0.9 of the total is more, 0.85 of it still fits the weights
    usable = f"MemTotal:       127600748 kB\nMemAvailable:   {int(101.5 * GIB / KIB)} kB\n"
    e = load_profile(SEED).engines[1].model_dump()
    m = NodeMemory.model_validate(gb10(usable))
    c = fit.check("spark1", e["name"], gpus=1, weights=SEED_WEIGHTS / 2, reserve=8.0 * GIB,
                  gpu_usable=m.gpu_usable, gpu_total=m.gpu_total,
                  args=["--gpu-memory-utilization", "0.9"])
    assert (c.weights_fit, c.fraction_fits) == (True, False)
    assert c.line() == ("spark1: vllm-ray does not fit: --gpu-memory-utilization 0.9 x 121.7 GiB "
                        "= 109.5 GiB > 101.5 GiB usable")


def test_discrete_gpus_per_gpu_share_times_gpus_on_the_node():
    # two H100 80GB on the node (nvidia-smi memory.total 81559 MiB, the smaller free 70000 MiB),
    # four ranks in all: each holds a quarter of the weights
    rows = mn.parse_gpus("0, NVIDIA H100 80GB HBM3, 81559, 80000\n"
                         "1, NVIDIA H100 80GB HBM3, 81559, 70000\n", mn.QUERY)
    m = NodeMemory.model_validate(mn.judge(rows, {}))
    c = fit.check("gpu1", "vllm", gpus=2, weights=SEED_WEIGHTS / 4, reserve=8.0 * GIB,
                  gpu_usable=m.gpu_usable, gpu_total=m.gpu_total,
                  args=["--gpu-memory-utilization=0.9"])
    assert c.line() == ("gpu1: vllm does not fit: --gpu-memory-utilization 0.9 x 159.3 GiB = "
                        "143.4 GiB > 136.7 GiB usable")
    c2 = fit.check("gpu1", "vllm", gpus=2, weights=SEED_WEIGHTS / 4, reserve=8.0 * GIB,
                   gpu_usable=m.gpu_usable, gpu_total=m.gpu_total, args=[])
    assert c2.fits and c2.asks is None
    assert c2.line() == ("gpu1: vllm fits: 74.2 GiB needed (58.2 GiB of weights + 16.0 GiB "
                         "reserve); 136.7 GiB usable of 159.3 GiB")


def test_the_boundary_is_inclusive():
    exact = fit.check("n", "e", gpus=1, weights=2 * GIB, reserve=1.0 * GIB,
                      gpu_usable=3 * GIB, gpu_total=4 * GIB, args=["--mem-fraction-static", "0.75"])
    assert exact.fits
    over = fit.check("n", "e", gpus=1, weights=2 * GIB + 1, reserve=1.0 * GIB,
                     gpu_usable=3 * GIB, gpu_total=4 * GIB, args=["--mem-fraction-static", "0.75"])
    assert (over.weights_fit, over.fraction_fits) == (False, True)
    assert over.line() == "n: e does not fit: 3.0 GiB needed (2.0 GiB of weights + 1.0 GiB reserve) > 3.0 GiB usable"


def test_context_sequences_and_kv_dtype_come_from_the_engines_args():
    s = seed_sized(gb10(), 0, args=["--mem-fraction-static", "0.85", "--context-length", "65536",
                                    "--max-running-requests", "8", "--kv-cache-dtype", "fp8_e4m3"])
    assert s.check.line() == ("spark2: sglang fits: 69.5 GiB needed (58.2 GiB of weights + 3.3 GiB "
                              "KV cache for 65536 tokens x 8 sequence(s) + 8.0 GiB reserve), "
                              "--mem-fraction-static 0.85 x 121.7 GiB = 103.4 GiB; 113.1 GiB "
                              "usable of 121.7 GiB")
    assert s.sources() == ("TP=2 x PP=1 (the profile's engine); context 65536 (--context-length in "
                           "the engine's args); 8 sequence(s) (--max-running-requests in the "
                           "engine's args); KV cache 1 byte(s) per element (--kv-cache-dtype "
                           "fp8_e4m3 in the engine's args)")


def test_pipeline_parallel_sizes_the_heaviest_stage():
    s = seed_sized(gb10(), 1, tensor_parallel=1, pipeline_parallel=2)
    assert (s.estimate.tp, s.estimate.pp, s.estimate.worst.layers) == (1, 2, 24)
    assert s.check.line().startswith("spark2: vllm-ray fits: 66.6 GiB needed (58.2 GiB of weights "
                                     "+ 0.4 GiB KV cache for 32768 tokens x 1 sequence(s)")


def test_a_tp_the_heads_do_not_divide_names_the_valid_ones():
    with pytest.raises(EstimateError) as e:
        seed_sized(gb10(), 0, tensor_parallel=3)
    assert str(e.value).startswith("TP=3 refused: 32 attention heads do not divide by 3")
    assert str(e.value).endswith("valid TPs: 1, 2, 4, 8, 16")


@pytest.mark.parametrize("args, why", [
    (["--max-running-requests", "many"], "--max-running-requests 'many' is not a whole number >= 1"),
    (["--context-length=0"], "--context-length '0' is not a whole number >= 1"),
    (["--context-length", "32k"], "--context-length '32k' is not a whole number >= 1"),
    (["--max-model-len", "1.5K"], "--max-model-len '1.5K' is not a whole number >= 1"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is not a KV cache dtype the fit knows "
                                   "(auto, bf16, bfloat16, fp8*, fp4*)"),
])
def test_engine_args_the_fit_cannot_read_are_one_line(args, why):
    with pytest.raises(fit.FitError) as e:
        seed_sized(gb10(), 0, args=args)
    assert str(e.value) == why


@pytest.mark.parametrize("args, want", [
    ([], ("auto", "no --kv-cache-dtype in the engine's args")),
    (["--kv-cache-dtype", "auto"], ("auto", "--kv-cache-dtype auto in the engine's args")),
    (["--kv-cache-dtype=fp8"], ("fp8", "--kv-cache-dtype fp8 in the engine's args")),
    (["--kv-cache-dtype", "fp8_e5m2"], ("fp8", "--kv-cache-dtype fp8_e5m2 in the engine's args")),
    (["--kv-cache-dtype", "fp4_e2m1"], ("fp8", "--kv-cache-dtype fp4_e2m1 in the engine's args")),
    (["--kv-cache-dtype", "bfloat16"], ("bf16", "--kv-cache-dtype bfloat16 in the engine's args")),
    (["--kv-cache-dtype", "bf16", "--kv-cache-dtype", "fp8"],
     ("fp8", "--kv-cache-dtype fp8 in the engine's args")),
])
def test_kv_cache_dtype_of_the_engines_args(args, want):
    assert fit.kv_choice(args) == want


@pytest.mark.parametrize("args, want", [
    ([], None),
    (["--max-model-len", "8192"], ("--max-model-len", 8192)),
    (["--context-length=4096", "--max-model-len", "2048"], ("--max-model-len", 2048)),
    (["--context-length"], None),
    (["--max-model-len", "32k"], ("--max-model-len", 32000)),  # vLLM's human_readable_int
    (["--max-model-len", "32K"], ("--max-model-len", 32768)),
    (["--max-model-len", "25.6k"], ("--max-model-len", 25600)),
])
def test_context_from_either_engines_flag_the_last_wins(args, want):
    assert fit.arg_count(args, fit.CONTEXT_FLAGS) == want


@pytest.mark.parametrize("args, want", [
    ([], None),
    (["--mem-fraction-static", "0.85"], ("--mem-fraction-static", 0.85)),
    (["--gpu-memory-utilization=0.7"], ("--gpu-memory-utilization", 0.7)),
    (["--gpu-memory-utilization", "0.5", "--gpu-memory-utilization", "0.8"],
     ("--gpu-memory-utilization", 0.8)),
    (["--gpu-memory-utilization", "1"], ("--gpu-memory-utilization", 1.0)),
    (["--gpu-memory-utilization"], None),
    (["--max-model-len", "0.85"], None),
])
def test_memory_fraction(args, want):
    assert fit.memory_fraction(args) == want


@pytest.mark.parametrize("args, why", [
    (["--mem-fraction-static", "most"], "--mem-fraction-static 'most' is not a number"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0 is not a fraction in (0, 1]"),
    (["--gpu-memory-utilization=1.2"], "--gpu-memory-utilization 1.2 is not a fraction in (0, 1]"),
    (["--gpu-memory-utilization=0.5=0.9"], "--gpu-memory-utilization '0.5=0.9' is not a number"),
])
def test_memory_fraction_refused(args, why):
    with pytest.raises(fit.FitError) as e:
        fit.memory_fraction(args)
    assert str(e.value) == why


def test_weight_bytes_count_weight_files_only():
    files = [{"path": "config.json", "size": 5}, {"path": "model-1.safetensors", "size": 100},
             {"path": "sub/w.bin", "size": 20}, {"path": "tokenizer.json", "size": 7}]
    assert fit.weight_bytes(files) == 120
    assert fit.weight_bytes(files[:1] + files[3:]) == 12  # no weight file: every file


def test_verdict_first_engine_that_fits_everywhere():
    def c(engine, node, usable):
        return fit.check(node, engine, gpus=1, weights=2 * GIB, reserve=0,
                         gpu_usable=usable, gpu_total=10 * GIB)

    both = {"a": [c("a", "n1", GIB), c("a", "n2", 5 * GIB)],
            "b": [c("b", "n1", 5 * GIB), c("b", "n2", 5 * GIB)]}
    assert fit.verdict(both) == ("b", both["b"])
    none = {"a": [c("a", "n1", GIB), c("a", "n2", 5 * GIB)], "b": [c("b", "n1", GIB), c("b", "n2", GIB)]}
    assert fit.verdict(none) == (None, none["a"])
    assert fit.verdict({}) == (None, [])


# --- the step, on fake nodes that answer the memory helper -------------------------------------

class MemoryNodes(FakeContext):
    """Nodes that stage the memory helper and answer it with their own figures; the head's
    model dir holds ``config`` as its config.json (None: no such file)."""

    def __init__(self, answers: dict[str, dict], config: dict | None = None):
        super().__init__()
        self._set("answers", answers)
        self._set("head_config", config)

    def answer(self, alias, argv, stdin, command, kw):
        if argv[:2] == ["cat", "--"]:
            assert alias == "spark1" and argv[2] == "/srv/models/Qwen3.5-122B-A10B-FP8/config.json"
            if self.head_config is None:
                return self.result(command, 1, "", f"cat: {argv[2]}: No such file or directory\n")
            return self.result(command, 0, json.dumps(self.head_config))
        if argv[:2] == ["sh", "-c"] and "base64 -d" in argv[2]:
            return self.result(command, 0, f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n")
        if argv[5].endswith("/model_node.py"):  # the head records no selection yet
            assert argv[6:8] == ["selection", "--dir"], argv
            return self.result(command, 0, '{"selection": null}\n')
        assert argv[5].endswith("/memory_node.py") and argv[6:] == ["read"], argv
        return self.result(command, 0, json.dumps(self.answers[alias]) + "\n")


def fit_deployment(tmp_path, answers, data=None, config: dict | None | str = "seed",
                   recipe: str | None = None, weights: int = SEED_WEIGHTS):
    """The profile ``data`` (None: the seed's, with its recipe, or ``recipe`` as
    ``deploy.all --recipe`` gives it) on nodes that answer ``answers``, the head's config.json
    ``config`` (``"seed"``: the seed recipe's), the hub listing ``weights`` bytes of weights."""
    path = write_profile(tmp_path, data) if data is not None else SEED
    cfg = seed_config() if config == "seed" else config
    dep = deployment(path, tmp_path / "state", MemoryNodes(answers, cfg),
                     profile=load_profile(path, recipe) if recipe else None)
    files = [{"path": f"model-0000{i}-of-00005.safetensors", "size": weights // 5,
              "sha256": None, "oid": None} for i in range(1, 6)]
    index = [f["path"] for f in files]
    files.append({"path": "config.json", "size": 4000, "sha256": None, "oid": None})
    files.append({"path": "model.safetensors.index.json", "size": 900, "sha256": None,
                  "oid": None})
    dep.records.write(HubMetadata(repo=dep.profile.model.repo, revision="main", commit="a" * 40,
                                  files=files, index=index, fetched_at=time.time()),
                      cache_name(dep))
    return dep


SMALL = "MemTotal:       127600748 kB\nMemAvailable:   4194304 kB\n"  # 4.0 GiB


def test_step_refuses_one_line_per_node_that_does_not_fit(tmp_path):
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10(SMALL)})
    res = model_fit.model_fit(dep)
    assert [(r.node, r.status) for r in res] == [("spark1", Status.OK), ("spark2", Status.FAILED)]
    assert res[1].why == (
        "spark2: sglang does not fit: 66.6 GiB needed (58.2 GiB of weights + 0.4 GiB KV cache for "
        "32768 tokens x 1 sequence(s) + 8.0 GiB reserve) > 4.0 GiB usable; --mem-fraction-static "
        "0.85 x 121.7 GiB = 103.4 GiB > 4.0 GiB usable (unified memory; weights 116.4 GiB; config "
        "recipe qwen3.5-122b-a10b-fp8's qwen3.5-122b-a10b-fp8.config.json; TP=2 x PP=1 (the "
        "profile's engine); context 32768 (--context-length in the engine's args); 1 sequence(s) "
        "(none of --max-running-requests, --max-num-seqs in its args: one, the least an engine "
        "holds at full context); KV cache 2 byte(s) per element (auto: the model's dtype bfloat16 "
        "(no dtype in config: bfloat16 assumed; vLLM's --kv-cache-dtype auto)))")
    assert res[0].why.startswith("spark1: sglang fits: 66.6 GiB needed")
    assert not any(argv[0] == "docker" for _, argv in dep.hosts["spark1"].ctx.calls)


def test_step_an_engine_that_does_not_fit_is_skipped_when_another_fits(tmp_path):
    data = seed_data()
    data["sparkdeploy"]["engines"][0]["args"] = ["--mem-fraction-static", "0.95"]
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()}, data)
    res = model_fit.model_fit(dep)
    assert [(r.node, r.status) for r in res] == [(None, Status.SKIPPED), ("spark1", Status.OK),
                                                 ("spark2", Status.OK)]
    assert res[0].why == ("spark1: sglang does not fit: --mem-fraction-static 0.95 x 121.7 GiB = "
                          "115.6 GiB > 113.1 GiB usable; spark2: sglang does not fit: "
                          "--mem-fraction-static 0.95 x 121.7 GiB = 115.6 GiB > 113.1 GiB usable "
                          "(vllm-ray does)")
    assert res[2].why.startswith("spark2: vllm-ray fits: ")


def test_step_reserve_from_the_profile(tmp_path):
    data = seed_data()
    data["sparkdeploy"]["fit"] = {"reserve_gib": 2.0, "engines": {"sglang": 60.0}}
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()}, data)
    res = model_fit.model_fit(dep)
    assert [r.status for r in res] == [Status.SKIPPED, Status.OK, Status.OK]
    assert ("118.6 GiB needed (58.2 GiB of weights + 0.4 GiB KV cache for 32768 tokens x 1 "
            "sequence(s) + 60.0 GiB reserve) > 113.1 GiB usable") in res[0].why
    assert res[1].why.startswith("spark1: vllm-ray fits: 60.6 GiB needed (58.2 GiB of weights + "
                                 "0.4 GiB KV cache for 32768 tokens x 1 sequence(s) + 2.0 GiB "
                                 "reserve)")


def test_step_a_node_without_figures_is_one_failed_line(tmp_path):
    no_gpu = mn.judge([], {})
    no_gpu["why"] = "nvidia-smi failed: NVIDIA-SMI has failed"
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": no_gpu})
    res = model_fit.model_fit(dep)
    assert [(r.node, r.status, r.why) for r in res] == [
        ("spark2", Status.FAILED, "spark2: no memory figures: nvidia-smi failed: NVIDIA-SMI has failed")]


def test_download_and_sync_need_the_fit():
    registry.load_all()
    plan = {"hosts.check", "services.stop", "model.fit", "model.download", "model.sync"}
    assert "model.fit" in registry.needs_in("model.download", plan)
    assert "model.fit" in registry.needs_in("model.sync", plan)
    assert registry.needs_in("model.fit", plan) == {"services.stop"}


def test_profile_fit_names_only_its_engines(tmp_path):
    from sparkdeploy.profile.config import ProfileError, load_profile

    data = seed_data()
    data["sparkdeploy"]["fit"] = {"engines": {"nope": 1.0}}
    with pytest.raises(ProfileError) as e:
        load_profile(write_profile(tmp_path, data))
    assert str(e.value).endswith("sparkdeploy.fit.engines.nope: no engine by that name")
    assert load_profile(SEED).fit.reserve("sglang") == 8.0


def test_step_a_tp_the_heads_do_not_divide_is_one_failed_line(tmp_path):
    data = seed_data()
    three_heads = {"num_hidden_layers": 4, "num_attention_heads": 3, "hidden_size": 384,
                   "max_position_embeddings": 262144}
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()}, data, config=three_heads)
    res = model_fit.model_fit(dep)
    assert [(r.status, r.why.split(" (vLLM")[0]) for r in res] == [
        (Status.FAILED, f"engine {e['name']}: TP=2 refused: 3 attention heads do not divide by 2")
        for e in data["sparkdeploy"]["engines"]]
    assert res[0].why.endswith("; valid TPs: 1, 3")


def test_step_reads_the_config_from_the_hub_when_the_head_has_none(tmp_path, monkeypatch):
    from sparkdeploy.ops import model_fit as ops_fit

    asked = []

    def hub(dep, commit, name):
        asked.append((commit, name))
        return json.dumps(seed_config()).encode()

    monkeypatch.setattr(ops_fit, "fetch_file", hub)
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()}, seed_data(), config=None)
    res = model_fit.model_fit(dep)
    assert asked == [("a" * 40, "config.json")]
    assert [r.status for r in res] == [Status.OK, Status.OK]
    assert "; config the hub's Qwen/Qwen3.5-122B-A10B-FP8@aaaaaaaaaaaa config.json; TP=2" in res[0].why


def test_step_without_any_config_is_one_failed_line(tmp_path, monkeypatch):
    from sparkdeploy.core.outside import OutsideError
    from sparkdeploy.ops import model_fit as ops_fit

    def hub(dep, commit, name):
        raise OutsideError(f"https://huggingface.co/x/resolve/{commit}/{name}: HTTP 404")

    monkeypatch.setattr(ops_fit, "fetch_file", hub)
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()}, seed_data(), config=None)
    res = model_fit.model_fit(dep)
    assert [(r.status, r.why) for r in res] == [(Status.FAILED, (
        "no config.json to size the model from: spark1:/srv/models/Qwen3.5-122B-A10B-FP8/"
        "config.json: cat: /srv/models/Qwen3.5-122B-A10B-FP8/config.json: No such file or "
        f"directory; https://huggingface.co/x/resolve/{'a' * 40}/config.json: HTTP 404"))]


def test_step_a_config_that_is_no_model_config_is_one_line(tmp_path):
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()}, seed_data(),
                         config={"architectures": ["X"]})
    res = model_fit.model_fit(dep)
    assert [(r.status, r.why) for r in res] == [
        (Status.FAILED, "not a model config: no num_hidden_layers or num_attention_heads")]


# --- model.precheck: before services.stop, each node's memory as it would be with the units gone ---

def test_precheck_counts_what_the_units_hold_as_usable_and_model_fit_does_not(tmp_path):
    # spark2's MemAvailable is 4 GiB (a unit still holds the rest): the bound is MemTotal less
    # the OS's 4 GiB, so the precheck passes and model.fit, after services.stop, decides
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10(SMALL)})
    pre = model_fit.model_precheck(dep)
    assert [(r.node, r.status) for r in pre] == [("spark1", Status.OK), ("spark2", Status.OK)]
    assert pre[1].why.startswith(
        "spark2: sglang fits: 66.6 GiB needed (58.2 GiB of weights + 0.4 GiB KV cache for 32768 "
        "tokens x 1 sequence(s) + 8.0 GiB reserve), --mem-fraction-static 0.85 x 121.7 GiB = "
        "103.4 GiB; 117.7 GiB usable of 121.7 GiB (unified memory, usable at most, every unit "
        "stopped: MemTotal less 4.0 GiB for the OS; weights 116.4 GiB;")
    assert [r.status for r in model_fit.model_fit(dep)] == [Status.OK, Status.FAILED]


def test_precheck_refuses_the_235b_recipe_on_two_sparks_with_the_numbers(tmp_path):
    dep = fit_deployment(tmp_path, {"spark1": gb10(), "spark2": gb10()},
                         recipe="qwen3-235b-a22b-instruct-2507-fp8", weights=236_000_000_000)
    res = model_fit.model_precheck(dep)
    assert [(r.node, r.status) for r in res] == [("spark1", Status.FAILED),
                                                 ("spark2", Status.FAILED), (None, Status.FAILED)]
    assert res[0].why.startswith(
        "spark1: sglang does not fit: 120.8 GiB needed (109.9 GiB of weights + 2.9 GiB KV cache "
        "for 32768 tokens x 1 sequence(s) + 8.0 GiB reserve) > 117.7 GiB usable (unified memory, "
        "usable at most, every unit stopped: MemTotal less 4.0 GiB for the OS; weights 219.8 GiB; "
        "config recipe qwen3-235b-a22b-instruct-2507-fp8's "
        "qwen3-235b-a22b-instruct-2507-fp8.config.json; TP=2 x PP=1")
    assert res[2].why == ("recipe qwen3-235b-a22b-instruct-2507-fp8 needs 3 node(s) of 117.7 GiB "
                          "(TP=1 x PP=3); the profile has 2 GPU(s)")


def test_precheck_on_discrete_gpus_counts_their_whole_memory():
    rows = mn.parse_gpus("0, NVIDIA H100 80GB HBM3, 81559, 20000\n", mn.QUERY)
    m = model_fit.at_most(NodeMemory.model_validate(mn.judge(rows, {})))
    assert (m.gpu_usable, m.source) == (81559 * MIB, "at most, every unit stopped: memory.total")
    assert model_fit.at_most(NodeMemory.model_validate(gb10())).gpu_usable == 127600748 * KIB - 4 * GIB


def test_the_precheck_comes_before_anything_stops_or_pulls():
    registry.load_all()
    plan = {"hosts.check", "model.precheck", "services.stop", "model.fit", "image.probe",
            "model.download"}
    assert registry.needs_in("services.stop", plan) == {"hosts.check", "model.precheck"}
    assert "model.precheck" in registry.needs_in("image.probe", plan)
    assert registry.needs_in("model.precheck", plan) == {"hosts.check"}


@pytest.mark.parametrize(("total_gib", "share_gib"), [(121.7, 4.0), (23.5, 23.5 * 0.05)])
def test_the_precheck_leaves_the_os_4_gib_or_5_percent_of_a_small_node(total_gib, share_gib):
    total = int(total_gib * fit.GIB)
    m = NodeMemory(gpus=1, names=["NVIDIA GB10"], unified=True, gpu_total=total,
                   gpu_usable=int(1 * fit.GIB))
    got = model_fit.at_most(m)
    assert got.gpu_usable == total - int(share_gib * fit.GIB)
    assert got.source == f"at most, every unit stopped: MemTotal less {fit.gib(share_gib * fit.GIB)} for the OS"
