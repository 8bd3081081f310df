"""`openk3 plan`'s exit status: a disaggregated plan is a plan when no aggregated layout meets the SLO."""

import argparse
from types import SimpleNamespace

import pytest

from openk3.planner import cli


@pytest.mark.parametrize(("disaggregated", "status"), [(object(), 0), (None, 1)])
def test_exit_status_with_only_a_disaggregated_plan(monkeypatch, capsys, disaggregated, status) -> None:
    plan = SimpleNamespace(problem="no aggregated layout meets 20 tok/s/user", disagg=SimpleNamespace(disaggregated=disaggregated))
    monkeypatch.setattr(cli, "build_request", lambda args: args)
    monkeypatch.setattr(cli, "make_plan", lambda request: plan)
    monkeypatch.setattr(cli, "render_text", lambda p: "the report")
    assert cli.run(argparse.Namespace(json=False, plot=None)) == status
    err = capsys.readouterr().err
    assert "no aggregated layout meets 20 tok/s/user" in err
    assert ("disaggregated plan above meets the SLO" in err) == (status == 0)
