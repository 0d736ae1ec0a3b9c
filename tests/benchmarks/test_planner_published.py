"""The step model against published deployments (``python -m benchmarks planner_published``): the device profiles
carry the fixed costs the fit gives, the held-out rows are predicted within the figures
``benchmarks/results/planner_published.json`` records, and every deployment names its source."""

import json
from pathlib import Path

import pytest

from benchmarks import planner_published as pp
from functional_npu.parallel.devices import DEVICES

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "planner_published.json"


@pytest.fixture(scope="module")
def result():
    return pp.run(plans=False)


def test_the_profiles_carry_the_fitted_fixed_costs(result):
    for dev, cost_ms in result["fixed_cost_ms"].items():
        assert DEVICES[dev].step_overhead_s == pytest.approx(cost_ms / 1e3, abs=5e-5), dev


def test_the_fit_and_its_held_out_rows_are_the_recorded_ones(result):
    recorded = json.loads(RESULTS.read_text())
    assert result["fixed_cost_ms"] == pytest.approx(recorded["fixed_cost_ms"])
    for got, was in zip(result["rows"], recorded["rows"], strict=True):
        assert got["name"] == was["name"]
        assert got["predicted"] == pytest.approx(was["predicted"], rel=1e-9)
    held = result["held_out"]
    assert held["rows"] >= 8 and held["median_error"] <= 0.25
    # the fixed cost is what closes the gap: the roofline alone is far off on the same rows
    assert held["median_error_bare"] > 2 * held["median_error"]


def test_every_deployment_names_its_source_and_every_device_kind_is_held_out():
    assert all(d.source for d in pp.DEPLOYMENTS)
    held = {d.device for d in pp.DEPLOYMENTS if d.role == "held out"}
    assert {"ascend-910b", "ascend-910c"} <= held and held & {"h100-sxm", "h200-sxm"}
    fitted = {d.name for d in pp.DEPLOYMENTS if d.role == "fit"}
    assert fitted.isdisjoint(d.name for d in pp.DEPLOYMENTS if d.role == "held out")


def test_an_output_path_without_its_folder_is_refused_before_anything_is_priced(capsys):
    from benchmarks.__main__ import main  # the runner checks every benchmark's output flags

    assert main(["planner_published", "--json", "no/such/dir/x.json"]) == 2
    assert "--json no/such/dir/x.json: no directory 'no/such/dir'" in capsys.readouterr().err
