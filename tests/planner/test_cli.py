"""The plan and simulate subcommands, wired the way the coci command wires them."""

from __future__ import annotations

import argparse
import json

import pytest

from coci_core.commands.simulate import add_subcommands, main

JOB = [
    "--total-steps",
    "20000",
    "--step-time-s",
    "0.3",
    "--stall-s",
    "0.5",
    "--persist-s",
    "2",
    "--mtbf-h",
    "8",
]
LOSS = ["--loss", "1.5+5.4*(1+k/3000)**-0.5"]


def test_subcommands_attach_to_a_host_parser_with_callable_defaults(capsys):
    """add_subcommands gives plan/simulate a func(args) -> int, as the coci command expects."""
    parser = argparse.ArgumentParser(prog="coci")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *JOB, *LOSS, "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"] == "time"  # the default: a lost step costs its wall time
    assert out["steps"] == sorted(out["steps"])
    assert len(out["steps"]) > 5
    assert out["expected_overhead_s"]["daly_wall_s"] > 0


def test_plan_prints_the_schedule_and_its_explanation(capsys):
    """coci plan prints the intervals, the inputs and the comparison with Daly."""
    assert main(["plan", *JOB, *LOSS]) == 0
    out = capsys.readouterr().out
    assert "Daly" in out
    assert "steps:" in out
    assert "exact curve" in out


def test_plan_reads_a_csv_of_observed_losses(tmp_path, capsys):
    """A CSV of step,loss (with a header) is fitted like observations."""
    path = tmp_path / "loss.csv"
    rows = ["step,loss"] + [f"{k},{1.5 + 5.4 * (1 + k / 3000) ** -0.5}" for k in range(0, 8000, 4)]
    path.write_text("\n".join(rows))
    assert main(["plan", *JOB, "--loss-csv", str(path)]) == 0
    assert "fitted" in capsys.readouterr().out


def test_simulate_prints_policies_by_metrics_with_confidence_intervals(capsys):
    """coci simulate prints one row per policy and ± intervals for each metric."""
    code = main(
        [
            "simulate",
            *JOB,
            *LOSS,
            "--runs",
            "300",
            "--policies",
            "daly,checkfreq,coci:time,coci:convergence",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for name in ("daly", "checkfreq", "coci[time]", "coci[convergence]"):
        assert name in out
    assert out.count("±") >= 12


@pytest.mark.parametrize("bad", [["--stall-s", "0"], ["--loss", "k +* 2"]])
def test_bad_arguments_exit_with_code_2_and_name_the_parameter(bad, capsys):
    """A bad value is reported on stderr with the parameter's name, exit code 2."""
    argv = ["plan", *JOB, *LOSS]
    flag = bad[0]
    i = argv.index(flag)
    argv[i + 1] = bad[1]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert flag.lstrip("-").replace("-", "_") in err or flag in err
