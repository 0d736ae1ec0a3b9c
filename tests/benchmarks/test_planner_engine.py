"""The planner-against-engine benchmark's plans and flags, checked without running it: every chosen plan is one the
planner ranks for the bench model on its world, and serves sequences under the default budget; bad flags are refused
before anything is measured."""

import pytest
import torch

from benchmarks.configs import QUICK
from benchmarks.planner_engine_check import CHOSEN, main, predicted
from functional_npu.runtime.planning import Workload


def test_every_chosen_plan_is_priced_and_admits_sequences_under_the_default_budget():
    served = predicted(QUICK, "910b", Workload.serve(128, 0.25, max_seqs=16, dtype=torch.float32), 330e6)
    assert list(served) == list(CHOSEN) and len(CHOSEN) >= 4
    assert all(s.batch > 0 and s.bytes["total"] <= 330e6 for s in served.values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "128", "--context", "128"], "--prompt 128 must be between 1 and --context 128 - 1"),
        (["--json", "no/such/dir/x.json"], "--json no/such/dir/x.json: its folder does not exist"),
    ],
)
def test_bad_flags_are_refused_before_measuring(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
