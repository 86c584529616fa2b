"""Cost curves: measured on the model, cached on disk under a key of what changes them, batches up to their size."""

import json

import pytest
from tiny_models import tiny_model

from lookahead.backends.transformers.costs import ModelMeter
from lookahead.backends.transformers.forward import ModelForward
from lookahead.decoding import costs


def test_rows_are_measured_up_to_the_first_count_that_holds_the_batch():
    assert costs.measured_rows(2) == (2,)
    assert costs.measured_rows(3) == (2, 4)
    assert costs.measured_rows(8) == (2, 4, 8)
    assert costs.measured_rows(64) == costs.BATCH_ROWS


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5"])
def test_bad_passes_name_the_variable(monkeypatch, text):
    monkeypatch.setenv(costs.PASSES_VARIABLE, text)
    with pytest.raises(ValueError, match=r"\$LOOKAHEAD_COST_PASSES must be a whole number"):
        costs.measuring_passes()


def test_passes_default_to_repeats(monkeypatch):
    monkeypatch.delenv(costs.PASSES_VARIABLE, raising=False)
    assert costs.measuring_passes() == costs.REPEATS
    monkeypatch.setenv(costs.PASSES_VARIABLE, " 2 ")
    assert costs.measuring_passes() == 2


@pytest.mark.usefixtures("one_thread")
def test_curves_are_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setenv(costs.PASSES_VARIABLE, "2")
    model = tiny_model("llama")
    model.config._name_or_path = "tiny-llama-for-costs"  # a model without a name is measured every time
    meter = ModelMeter(ModelForward(model), "packed")
    calls = []
    measure = costs.measure_cost

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return measure(*args, **kwargs)

    monkeypatch.setattr(costs, "measure_cost", counted)
    model_costs = costs.cost_model(meter, max_batch=3)
    assert model_costs.rows == [1, 2, 4]
    assert {call["repeats"] for call in calls} == {2}
    assert sorted(call["rows"] for call in calls if "rows" in call) == [2, 4]
    keys = json.loads((tmp_path / "costs.json").read_text())
    assert all("tiny-llama-for-costs" in key and "fastest-of=2" in key for key in keys)
    assert len(keys) == len(calls) == 1 + len(costs.longer_contexts(meter)) + 2

    calls.clear()
    again = costs.cost_model(meter, max_batch=4)
    assert calls == [] and again.rows == [1, 2, 4], "every curve came from the cache"
    costs.cost_model(meter, max_batch=8)
    assert [call["rows"] for call in calls] == [8], "only the row count not measured before"
