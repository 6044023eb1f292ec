"""The unit writer refuses a value that would end or continue its line, whatever the schema let
through (defence in depth: the profile's types already refuse these)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkdeploy.ops.units import UnitValueError, unit_file
from sparkdeploy.profile.config import load_profile
from sparkdeploy.steps.serve_persist import unit_text
from tests.unit.profiles import SEED
from tests.unit.test_doors_profile import INJECTED


@pytest.mark.parametrize("value", ["a\nExecStartPre=/bin/true", "a\rb", "a\x1b[2Jb", "a\x00b",
                                   "a\u2028b", "a\x85b", "trailing\\"])
def test_a_value_that_would_break_its_line_is_refused(value):
    with pytest.raises(UnitValueError, match="cannot go into a unit file"):
        unit_file({"Unit": [("Description", value)]})


def test_a_percent_is_not_a_specifier():
    assert unit_file({"Unit": [("Description", "100% of %n")]}) == "[Unit]\nDescription=100%% of %%n\n"


def test_unit_text_from_a_profile_that_bypassed_the_schema_is_refused():
    prof = load_profile(SEED)
    forged = prof.model_copy(update={"name": INJECTED})  # model_copy does not validate
    dep = SimpleNamespace(profile=forged)
    with pytest.raises(UnitValueError):
        unit_text(dep, prof.engines[0], SimpleNamespace(name="spark1"), ["head"])


def test_unit_text_of_the_seed():
    prof = load_profile(SEED)
    text = unit_text(SimpleNamespace(profile=prof), prof.engines[0], SimpleNamespace(name="spark1"),
                     ["head"])
    assert text.splitlines()[:2] == [
        "[Unit]", "Description=sparkdeploy sglang (head) of qwen3.5-122b-a10b-fp8 on spark1"]
    assert "ExecStart=/usr/bin/python3 /var/lib/sparkdeploy-node/serve/serve_unit.py run --spec " \
           "/var/lib/sparkdeploy-node/serve/sglang.json" in text.splitlines()
