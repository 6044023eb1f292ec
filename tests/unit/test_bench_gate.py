"""The coherence gate of a model that cannot add: the answers its recipe recorded for its exact
weights (``about.gate``), checked against the served model; everything else keeps the fixed
prompts."""

from __future__ import annotations

import pytest
import yaml

from sparkdeploy.bench import gate
from sparkdeploy.bench.client import BenchError, Target
from sparkdeploy.lab import internet, tiny
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.profile import recipes
from sparkdeploy.profile.config import Bench
from sparkdeploy.steps.bench import request_settings

MODEL = "Qwen/Qwen3.5-122B-A10B-FP8"  # the stand-in's served name


@pytest.fixture
def server():
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=5, gap_ms=1))
    yield srv
    srv.shutdown()
    srv.server_close()


def settings(*gates):
    return request_settings(Bench(), model=MODEL, timeout=5, deadline=10, gates=gates)


def test_a_model_without_a_recipe_gate_gets_the_fixed_prompts():
    s = settings(("other/model", (("p", "a"),), 4, "x"))
    assert gate.prompts_for(s) == (gate.PROMPTS, gate.MAX_TOKENS)


def test_a_recipe_gate_is_asked_and_its_recorded_answer_passes(server):
    pairs = (("Repeat this word exactly, nothing else: mango", "mango"),)
    answers = gate.check(Target.parse(f"http://127.0.0.1:{server.port}"),
                         settings((MODEL, pairs, 8, "recorded")))
    assert [(a.prompt, a.answer) for a in answers] == [(pairs[0][0], "mango")]


def test_an_answer_other_than_the_recorded_one_is_refused(server):
    pairs = (("Repeat this word exactly, nothing else: mango", "kiwi"),)
    with pytest.raises(BenchError) as e:
        gate.check(Target.parse(f"http://127.0.0.1:{server.port}"), settings((MODEL, pairs, 8, "x")))
    assert str(e.value) == ("coherence gate: 'Repeat this word exactly, nothing else: mango' came back "
                            "'mango', not 'kiwi': the model answers nonsense; no figures")


def test_the_garbage_fault_fails_a_recipe_gate_too(server):
    server.state.control({"faults": "garbage"})
    pairs = (("Repeat this word exactly, nothing else: mango", "mango"),)
    with pytest.raises(BenchError, match="came back .* not 'mango'"):
        gate.check(Target.parse(f"http://127.0.0.1:{server.port}"), settings((MODEL, pairs, 8, "x")))


def test_lab_tiny_records_its_greedy_answers_and_the_lab_profile_finds_them():
    [(repo, pairs, cap, source)] = [g for g in recipes.gates([internet.RECIPES]) if g[0] == tiny.REPO_ID]
    assert [p for p, _ in pairs] == [p for p, _ in gate.PROMPTS]
    assert cap == 8 and "single" in source
    assert all(a for _, a in pairs)
    # an owner's profile (the package's recipes only) has no such gate
    assert recipes.gates(recipes.directories()) == ()


@pytest.mark.parametrize("bad,why", [
    ({"answers": [], "max_tokens": 8, "source": "s"}, "answers: a list of {prompt: text, answer: text}"),
    ({"answers": [{"prompt": "p"}], "max_tokens": 8, "source": "s"},
     "answers: a list of {prompt: text, answer: text}"),
    ({"answers": [{"prompt": "p", "answer": "a"}], "max_tokens": 0, "source": "s"},
     "max_tokens: a whole number 1..64"),
    ({"answers": [{"prompt": "p", "answer": "a"}], "max_tokens": True, "source": "s"},
     "max_tokens: a whole number 1..64"),
    ({"answers": [{"prompt": "p", "answer": "a"}], "max_tokens": 8}, "source: where the answers come from"),
])
def test_a_malformed_recipe_gate_is_one_line_naming_the_key(tmp_path, bad, why):
    body = yaml.safe_load((internet.RECIPES / "lab-tiny.yaml").read_text())
    body["sparkdeploy"]["about"]["gate"] = bad
    (tmp_path / "lab-tiny.yaml").write_text(yaml.safe_dump(body))
    (tmp_path / "lab-tiny.config.json").write_bytes((internet.RECIPES / "lab-tiny.config.json").read_bytes())
    with pytest.raises(recipes.RecipeError) as e:
        recipes.gates([tmp_path])
    assert str(e.value) == f"{tmp_path / 'lab-tiny.yaml'}: sparkdeploy.about.gate.{why}"


def _gated(tmp_path, name: str, gate_value) -> None:
    """``name``: lab-tiny's recipe with ``gate_value`` as its gate (None: no gate)."""
    body = yaml.safe_load((internet.RECIPES / "lab-tiny.yaml").read_text())
    if gate_value is None:
        body["sparkdeploy"]["about"].pop("gate", None)
    else:
        body["sparkdeploy"]["about"]["gate"] = gate_value
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(body))
    (tmp_path / f"{name}.config.json").write_bytes((internet.RECIPES / "lab-tiny.config.json").read_bytes())


@pytest.mark.parametrize("cap", [1, recipes.GATE_MAX_TOKENS])
def test_a_gate_after_a_recipe_without_one_is_found_and_both_ends_of_the_token_cap_are_taken(tmp_path, cap):
    _gated(tmp_path, "a-first", None)  # read first (by name): no gate, the next one still counts
    _gated(tmp_path, "b-gated", {"answers": [{"prompt": "p", "answer": "a"}], "max_tokens": cap, "source": "s"})
    assert [(pairs, c, src) for _, pairs, c, src in recipes.gates([tmp_path])] == [((("p", "a"),), cap, "s")]


def test_a_gate_that_is_not_a_mapping_is_one_line(tmp_path):
    _gated(tmp_path, "lab-tiny", "yes")
    with pytest.raises(recipes.RecipeError, match=r"sparkdeploy\.about\.gate\.answers: a list of"):
        recipes.gates([tmp_path])
