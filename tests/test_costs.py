"""Cost curves: measured on the model, cached on disk under a key of what changes them, batches up to their size;
trusted only when measured on a quiet machine, and doubted when real steps run well under their price."""

import contextlib
import json
import subprocess
import sys
import time

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


class ClockedMeter:
    """Passes that take `milliseconds(width)` on a clock of its own (no sleeping: the machine's load cannot move the
    curve), and the widths run."""

    key = batch_key = ""
    max_positions = None

    def __init__(self, milliseconds) -> None:
        self.milliseconds = milliseconds
        self.ran: list[int] = []
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    @contextlib.contextmanager
    def passes(self, rows, context):
        def run(width):
            self.ran.append(width)
            self.now += self.milliseconds(width) / 1000

        yield run


def test_a_curve_ends_at_the_first_width_as_dear_as_its_tokens_in_one_token_passes(monkeypatch):
    linear = ClockedMeter(lambda width: 2.0 * width)
    monkeypatch.setattr(costs, "time", linear)  # measure_cost reads this meter's clock
    curve = costs.measure_cost(linear, repeats=2)
    assert list(curve) == [1, 2, 3, 4, 6, 8], curve  # 8 tokens cost 8 one-token passes: the curve ends there
    assert set(linear.ran) == set(curve) and 64 not in linear.ran, "a width past the end was run"
    assert costs.CostModel(curve).predict(64) > 0.9 * 2.0 * 64, "wider passes priced by carrying the last segment on"
    flat = ClockedMeter(lambda width: 2.0 + 0.05 * width)
    monkeypatch.setattr(costs, "time", flat)
    assert list(costs.measure_cost(flat, repeats=2)) == list(costs.COST_WIDTHS)


class Quiet:
    """The rest of the machine as these tests want it: `share` of its CPU time taken by others."""

    share_now = 0.0

    def restart(self) -> None:
        pass

    def share(self) -> float:
        return self.share_now

    def quiet(self) -> bool:
        return self.share_now <= costs.QUIET


@pytest.fixture
def quiet(monkeypatch):
    """Measurements and checks see a quiet machine, whatever else the test machine runs meanwhile."""
    monkeypatch.setattr(costs, "OthersLoad", Quiet)
    monkeypatch.setattr(Quiet, "share_now", 0.0)  # a test that makes it busy leaves it quiet for the next
    return Quiet


@pytest.mark.usefixtures("one_thread", "quiet")
def test_curves_are_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setenv(costs.PASSES_VARIABLE, "2")
    model = tiny_model("llama")
    model.config._name_or_path = "tiny-llama-for-costs"  # a model without a name is measured every time
    meter = ModelMeter(ModelForward(model), "packed")
    calls = []  # whole curves measured; implausible points timed again on a noisy machine are not counted
    measure = costs.measure_cost

    def counted(meter, widths=costs.COST_WIDTHS, **kwargs):
        if tuple(widths) in (costs.COST_WIDTHS, costs.BATCH_WIDTHS):
            calls.append(kwargs)
        return measure(meter, widths, **kwargs)

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


LOADED = {1: 194.9, 2: 453.0, 3: 266.2, 4: 598.4, 6: 508.3, 8: 425.2, 12: 304.4, 16: 329.5, 24: 333.8, 32: 511.5,
          48: 339.1, 64: 230.4}  # fmt: skip
"""SmolLM2's one-row curve as a run of the test suite measured it beside a package install (fastest of one)."""
QUIET = {1: 65.8, 2: 103.6, 3: 128.3, 4: 90.8, 6: 101.5, 8: 116.4, 12: 128.6, 16: 139.5, 24: 144.5, 32: 151.6,
         48: 187.9, 64: 229.7}  # fmt: skip
"""The same curve on a quiet machine (fastest of five): 3 tokens dearer than 4, 6 and 8, as CPUs' kernels make it."""


def test_points_dearer_than_a_much_wider_pass_are_implausible():
    assert costs.implausible(QUIET) == []
    assert costs.implausible(LOADED) == [2, 4, 6, 8, 32]


def test_implausible_points_are_measured_again_and_the_fastest_kept(quiet):
    asked = []

    def measure(widths):
        asked.append(list(widths))
        return {w: QUIET[w] for w in widths} if len(asked) > 1 else {w: LOADED[w] for w in widths}

    entry = costs.measure_entry(measure, list(LOADED))
    assert asked == [list(LOADED), [2, 4, 6, 8, 32], [1, 3, 12, 16]], "until what is left is plausible"
    assert entry["trusted"] and entry["ms"]["1"] == QUIET[1] and entry["ms"]["24"] == LOADED[24]


def test_a_curve_measured_while_the_machine_is_busy_is_not_trusted_and_keeps_the_fastest_points():
    """Real load: two processes spin on the machine's cores while the 'measurement' waits."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.3)
        calls = []

        def measure(widths):
            calls.append(widths)
            time.sleep(1.0)  # a measurement the others' load falls on
            return {w: QUIET[w] * (2.0 if len(calls) == 1 else 1.5) for w in widths}

        earlier = costs._entry({1: 60.0, 64: 400.0}, 0.9, trusted=False)
        entry = costs.measure_entry(measure, [1, 64], earlier)
    finally:
        for spinner in spinners:
            spinner.kill()
    assert len(calls) == costs.ATTEMPTS, "measured again while the machine was busy"
    assert entry["trusted"] is False and entry["others"] > costs.QUIET
    assert entry["ms"] == {"1": 60.0, "64": round(QUIET[64] * 1.5, 3)}, "the fastest of every attempt and the earlier"


@pytest.mark.usefixtures("one_thread", "quiet")
def test_untrusted_entries_are_measured_again_at_the_next_start(monkeypatch, tmp_path):
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setenv(costs.PASSES_VARIABLE, "1")
    model = tiny_model("llama")
    model.config._name_or_path = "tiny-llama-for-trust"
    meter = ModelMeter(ModelForward(model), "packed")
    costs.cost_model(meter, max_batch=2)
    path = tmp_path / "costs.json"
    known = json.loads(path.read_text())
    assert all(entry["trusted"] for entry in known.values())
    old, doubted, *_ = known
    known[old] = {"1": 5.0, "64": 50.0}  # an entry of the old format, measured with no check
    known[doubted].update(trusted=False, doubt="found too dear")
    path.write_text(json.dumps(known))
    costs.cost_model(meter, max_batch=2)
    again = json.loads(path.read_text())
    assert again[old]["trusted"] and again[doubted]["trusted"] and "doubt" not in again[doubted], "measured again"
    assert all(again[name] == known[name] for name in known if name not in (old, doubted)), "the others kept"


@pytest.mark.usefixtures("one_thread")
def test_an_untrusted_entry_is_used_as_it_is_while_the_machine_stays_busy(monkeypatch, tmp_path, quiet):
    """Measuring again on a busy machine would give no better curve, and cost every start a measurement."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setenv(costs.PASSES_VARIABLE, "1")
    monkeypatch.setattr(costs, "QUIET_PROBE_S", 0.0)
    model = tiny_model("llama")
    model.config._name_or_path = "tiny-llama-busy"
    meter = ModelMeter(ModelForward(model), "packed")
    costs.cost_model(meter)
    path = tmp_path / "costs.json"
    known = json.loads(path.read_text())
    name = next(iter(known))
    known[name].update(trusted=False, ms={"1": 7.0, "64": 70.0})
    path.write_text(json.dumps(known))
    quiet.share_now = 0.6
    assert costs.cost_model(meter).base == [7.0, 70.0] and json.loads(path.read_text()) == known
    quiet.share_now = 0.0
    costs.cost_model(meter)
    assert json.loads(path.read_text())[name]["trusted"], "measured again once the machine is quiet"


def test_steps_well_under_their_price_on_a_quiet_machine_mark_the_cached_curves_untrusted(quiet, tmp_path):
    path = tmp_path / "costs.json"
    names = ["one row", "two rows", "measured again since"]
    known = {name: costs._entry(LOADED, 0.0, trusted=True) for name in names}
    path.write_text(json.dumps({**known, names[2]: costs._entry(QUIET, 0.0, trusted=True)}))
    cost = costs.CheckedCost(LOADED, {2: LOADED}, None, entries=(path, {name: known[name]["ms"] for name in names}))
    for _ in range(costs.CHECK_STEPS - 1):
        cost.observe(1, 0.35 * LOADED[1])
    assert cost.doubt is None, "not before a check"
    cost.observe(1, 0.35 * LOADED[1])
    assert cost.doubt == "steps of 1 row(s) x 1 token(s) ran at 0.35x their measured price"
    known = json.loads(path.read_text())
    assert [known[name]["trusted"] for name in names] == [False, False, True], "only the entries it priced by"
    assert known["one row"]["doubt"] == cost.doubt


@pytest.mark.parametrize(("others", "ratio"), [(0.5, 0.35), (0.0, 1.4)])
def test_curves_are_not_doubted_on_a_busy_machine_nor_by_dearer_steps(quiet, tmp_path, others, ratio):
    """A busy machine says nothing of the curves; steps dearer than priced are what the online correction is for."""
    quiet.share_now = others
    path = tmp_path / "costs.json"
    entry = costs._entry(QUIET, 0.0, trusted=True)
    path.write_text(json.dumps({"one row": entry}))
    cost = costs.CheckedCost(QUIET, None, None, entries=(path, {"one row": entry["ms"]}))
    for _ in range(2 * costs.CHECK_STEPS):
        cost.observe(1, ratio * QUIET[1])
    assert cost.doubt is None and json.loads(path.read_text())["one row"]["trusted"]


def test_the_cache_keeps_its_last_measured_entries(monkeypatch, tmp_path):
    monkeypatch.setattr(costs, "CACHE_ENTRIES", 3)
    path = tmp_path / "costs.json"
    known = {f"model-{day}": {"ms": {"1": 10.0, "2": 12.0}, "measured": f"2026-12-0{day}T00:00:00+0000"}
             for day in (4, 1, 6, 2, 5)}  # fmt: skip
    known["damaged"] = "not an entry"
    costs.write_cache(path, known)
    assert sorted(costs.read_cache(path)) == ["model-4", "model-5", "model-6"]
    costs.write_cache(path, {"model-3": known["model-2"]})
    assert list(costs.read_cache(path)) == ["model-3"], "a cache within the limit is written as it is"
