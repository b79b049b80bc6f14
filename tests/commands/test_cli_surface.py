"""CLI polish: the parser imports nothing heavy, verify names each key once, report never
prints None, plan takes the fixed-interval policies' options, every argument has help."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import coci_core
from coci_core import CheckpointManager
from coci_core.commands.cli import build_parser, main
from coci_core.engine.format.manifest import step_dir_name
from coci_core.planner.schedule import ExpectedOverhead
from coci_core.telemetry import JsonlTelemetry
from tests.harness.processes import run, script

JOB = ["--total-steps", "2000", "--step-time-s", "0.3", "--stall-s", "0.5", "--mtbf-h", "8"]


def test_the_cli_parser_imports_no_torch_numpy_or_scipy() -> None:
    """Importing coci_core.commands.cli and building its whole parser (with its help) imports
    none of
    torch, numpy, scipy, safetensors. (coci_core/__init__ is bypassed here: it imports the
    engine, and so torch, by itself.)"""
    src = str(Path(coci_core.__file__).parent)
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('coci_core')\n"
        f"pkg.__path__ = [{src!r}]\n"
        "sys.modules['coci_core'] = pkg\n"
        "import coci_core.commands.cli as cli\n"
        "parser = cli.build_parser()\n"
        "parser.format_help()\n"
        "args = parser.parse_args(['plan', '--total-steps', '9', '--step-time-s', '1',"
        " '--stall-s', '1', '--mtbf-s', '9'])\n"
        "assert args.command == 'plan'\n"
        "for action in parser._subparsers._group_actions:\n"
        "    for sub in action.choices.values():\n"
        "        sub.format_help()\n"
        "print(sorted(m for m in ('torch', 'numpy', 'scipy', 'safetensors') if m in sys.modules))\n"
    )
    proc = run(script(code))
    assert proc.stdout.strip().splitlines()[-1:] == ["[]"], proc.stdout + proc.stderr


def test_the_cli_names_of_policies_and_objectives_are_the_planner_s() -> None:
    from coci_core.commands.plan import OBJECTIVE_NAMES, POLICY_NAMES
    from coci_core.planner.optimize import OBJECTIVES
    from coci_core.planner.policies import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES
    assert tuple(OBJECTIVES) == OBJECTIVE_NAMES


def test_verify_names_each_damaged_key_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line per damaged tensor naming it once, then a summary without the list."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(9, {"alpha": torch.randn(64), "beta": torch.randn(64)}).wait()
    manifest = json.loads((tmp_path / step_dir_name(9) / "manifest.json").read_text())
    for entry in manifest["tensors"]:
        piece = entry["pieces"][0]
        data = tmp_path / step_dir_name(9) / piece["file"]
        raw = bytearray(data.read_bytes())
        raw[piece["offset"] + 3] ^= 0x10
        data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "step 9: 2 damaged"
    for key in ("/alpha", "/beta"):
        (line,) = [x for x in lines if key in x]
        assert line.count(key) == 1 and "checksum" in line and "step 9" not in line, line


def test_report_never_prints_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Telemetry with values not known yet (no interval, an infinite MTBF and overhead, a
    save without timings, a restore without its duration) prints '-', '?' or 'unknown'."""
    tel = JsonlTelemetry(tmp_path / "telemetry.jsonl")
    report = SimpleNamespace(
        policy="coci",
        objective="time",
        next_steps=(),
        interval_steps=None,
        mtbf_s=float("inf"),
        mtbf_source=None,
        costs={"step_time_s": None},
        cost_sources={},
        expected_overhead=ExpectedOverhead(
            objective="time",
            objective_s=float("inf"),
            wall_s=1.0,
            daly_objective_s=float("nan"),
            daly_wall_s=2.0,
            plan=None,  # type: ignore[arg-type]
            daly=None,  # type: ignore[arg-type]
        ),
    )
    tel.record_plan(3, report)
    tel.close()
    with (tmp_path / "telemetry.jsonl").open("a") as f:
        f.write(json.dumps({"type": "save", "step": 4, "outcome": "committed"}) + "\n")
        f.write(json.dumps({"type": "restore", "step": 4, "seconds": None}) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "None" not in out, out
    assert "no checkpoint planned after step 3" in out and "MTBF unknown" in out
    assert "plan 1.0 s wall-clock (? s by its objective) vs Daly 2.0 s (? s)" in out


def test_plan_takes_every_n_steps_seconds_and_steps_per_epoch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--every-n-steps alone plans every_n_steps; --policy epoch needs --steps-per-epoch."""
    assert main(["plan", *JOB, "--every-n-steps", "500", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "every_n_steps" and out["steps"] == [500, 1000, 1500]
    assert main(["plan", *JOB, "--policy", "epoch", "--steps-per-epoch", "700", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [700, 1400]
    assert main(["plan", *JOB, "--every-n-seconds", "300", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [1000]
    assert main(["plan", *JOB, "--policy", "epoch"]) == 2
    assert "--steps-per-epoch" in capsys.readouterr().err
    assert main(["plan", *JOB, "--every-n-steps", "5", "--every-n-seconds", "9"]) == 2
    assert "one of" in capsys.readouterr().err


def _actions(parser: argparse.ArgumentParser, prog: str) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _actions(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            found.append((prog, action))
    return found


def test_every_argument_has_help() -> None:
    """Every positional and option of every subcommand has a help text."""
    actions = _actions(build_parser(), "coci")
    assert len(actions) > 40
    missing = [f"{prog} {a.option_strings or a.dest}" for prog, a in actions if not a.help]
    assert missing == []
