"""Public arguments fuzzed at and beyond their bounds: each bad value is refused where it is
given, by coci's own error naming the argument, never accepted to fail later (in the
background, in every re-plan) and never misread (a string read as true, a negative rank as the
last one). Found by an attacker's review of every public argument."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from coci_core import CheckpointManager, ConfigError
from coci_core.commands.cli import main
from coci_core.engine.save.compress import CompressionPolicy
from coci_core.planner import CheckFreq, Planner
from coci_core.preemption.signals import SignalNotice
from coci_core.storage import check_url
from coci_core.training import CheckpointOptions
from coci_core.training.preemption import plan_save_step
from tests.harness.processes import module, run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bits", [8.0, 4.0, True, "8", None])
def test_lossy_bits_that_only_compare_equal_are_refused(bits: Any) -> None:
    """8.0 == 8 passed the check, and every delta save then failed in the writer thread."""
    with pytest.raises(ConfigError, match="'lossy_bits' must be 8, 4, 2 or 'auto'"):
        CompressionPolicy(mode="lossy", lossy_bits=bits)


@pytest.mark.parametrize("value", [float("nan"), -1, "1", True])
def test_bad_timeouts_are_refused_and_close_still_closes(tmp_path: Path, value: Any) -> None:
    """``close(upload_timeout_s=inf)`` crashed inside threading after marking the manager
    closed, leaving the lease held; bad values are refused before anything happens, and a
    timeout beyond what a wait accepts waits as long as it may."""
    mgr = CheckpointManager(tmp_path)
    handle = mgr.save(1, {"w": torch.ones(3)})
    with pytest.raises(ConfigError, match="'timeout_s'"):
        mgr.wait(value)
    with pytest.raises(ConfigError, match="'timeout_s'"):
        handle.wait(value)
    with pytest.raises(ConfigError, match="'upload_timeout_s'"):
        mgr.close(upload_timeout_s=value)
    mgr.wait(math.inf)
    handle.wait(1e308)
    mgr.close(upload_timeout_s=math.inf)
    with CheckpointManager(tmp_path) as again:  # the lease was given back
        again.save(2, {"w": torch.zeros(3)}).wait()
        assert again.steps() == [1, 2]


@pytest.mark.parametrize("lead", [math.inf, 1e308, 86_401])
def test_a_preemption_lead_time_beyond_a_day_is_refused(lead: float) -> None:
    """``USR1@inf`` was accepted and the notice never stopped training; ``USR1@1e308`` made
    the next ``should_save`` raise an OverflowError."""
    with pytest.raises(ConfigError, match="lead time of SIGUSR1 must be a number of seconds"):
        SignalNotice("USR1", lead)
    # a deadline far beyond any run: the save is not moved (no overflow)
    assert plan_save_step(7, 1e308, 1e-300, 1.0, 3.0) == 7


@pytest.mark.parametrize("spec", ["TERM@-5", "USR1@0", "aws@notaurl", "aws@", "gce@ "])
def test_a_preemption_source_with_a_bad_argument_names_the_option(spec: str) -> None:
    """``preemption="TERM@-5"`` said "the lead time of SIGTERM must be ..." naming no argument
    (``"TERM@abc"`` named ``'preemption'``): each names the option and the source given."""
    with pytest.raises(ConfigError, match=rf"^'preemption' source '{spec}': "):
        CheckpointOptions.check(dirpath="ckpt", preemption=spec)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Planner(policy="checkfreq", checkfreq_overhead_bound="0.05"),
        lambda: Planner(policy=CheckFreq(overhead_bound="0.05")),
        lambda: Planner(mtbf_s="3600"),
        lambda: Planner(mtbf_s=10**400),
        lambda: Planner(mtbf_s=True),
    ],
    ids=["option-string", "object-string", "mtbf-string", "mtbf-huge", "mtbf-bool"],
)
def test_numbers_given_as_strings_or_beyond_floats_are_refused(make: Any) -> None:
    """A number-like string passed a float() check and was kept: every re-plan then failed
    and the planner never saved."""
    with pytest.raises(ConfigError, match=r"must be (a number|finite)"):
        make()


def test_a_grid_too_large_to_replan_in_time_is_refused() -> None:
    """``grid_points=100_000`` held the training thread over a minute in one re-plan."""
    with pytest.raises(ConfigError, match=r"'grid_points' must be in \[2, 10000\]"):
        Planner(mtbf_s=60, objective="convergence", grid_points=100_000)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"rank": -1}, "'rank' must be None or an integer"),
        ({"rank": 1.5}, "'rank' must be None or an integer"),
        ({"rank": "0"}, "'rank' must be None or an integer"),
        ({"strict": "no"}, "'strict' must be None, True or False"),
        ({"targets": 5}, "'targets' must be None or InPlaceTargets"),
        ({"step": 1.0}, "'step' must be a step"),
        ({"step": True}, "'step' must be a step"),
        ({"step": -1}, "'step' must be a step"),
    ],
)
def test_restore_arguments_are_checked_not_misread(
    tmp_path: Path, kwargs: dict[str, Any], said: str
) -> None:
    """``rank=-1`` returned the last rank's state (negative indexing); ``rank="0"`` and
    ``targets=5`` reported every intact checkpoint as damaged; ``step=True`` was step 1."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}, per_rank={"seed": torch.tensor([1])}).wait()
        with pytest.raises(ConfigError, match=said):
            mgr.restore(**kwargs)
        with pytest.raises(ConfigError, match="must be a step"):
            mgr.verify(1.0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="must be a step"):
            mgr.manifest([])  # type: ignore[arg-type]
        assert mgr.verify(1) == {1: []}
        with pytest.raises(ConfigError, match="'remote' must be True or False"):
            mgr.steps(remote="yes")  # type: ignore[arg-type]
        assert mgr.steps(remote=True) == mgr.steps() == [1]  # no remote tier: the local's


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"allow_torch_save": "False"}, "'allow_torch_save' must be True or False"),
        ({"strict": "no"}, "'strict' must be True or False"),
        ({"listeners": print}, "'listeners' must be a list of callables"),
        ({"listeners": 5}, "'listeners' must be a list of callables"),
        ({"storage_options": [1]}, "'storage_options' must be a dict"),
        ({"storage_options": {"anon": True}}, "'storage_options' apply to an fsspec URL"),
        (
            {"remote": "REMOTE", "remote_storage_options": {"anon": True}},
            "'remote_storage_options' apply to an fsspec URL",
        ),
    ],
)
def test_manager_flags_and_containers_are_checked(
    tmp_path: Path, kwargs: dict[str, Any], said: str
) -> None:
    """``allow_torch_save="False"`` switched pickling on (the string is true); fsspec options
    given with a local directory were ignored."""
    if kwargs.get("remote") == "REMOTE":
        kwargs = {**kwargs, "remote": str(tmp_path / "remote")}
    with pytest.raises(ConfigError, match=said):
        CheckpointManager(tmp_path / "run", **kwargs)
    with CheckpointManager(tmp_path / "run") as mgr:  # nothing was left held
        mgr.save(1, {"w": torch.ones(2)}).wait()


@pytest.mark.parametrize("spelling", ["same", "trailing-slash", "symlink"])
def test_a_remote_tier_that_is_the_directory_itself_is_refused(
    tmp_path: Path, spelling: str
) -> None:
    """``remote=`` the local directory was accepted, and every upload then found the directory
    in use by this very manager (logged once: nothing was ever uploaded)."""
    local = tmp_path / "run"
    local.mkdir()
    remote: Any = {"same": local, "trailing-slash": f"{local}/", "symlink": tmp_path / "link"}[
        spelling
    ]
    (tmp_path / "link").symlink_to(local)
    with pytest.raises(ConfigError, match="'remote' must be another place than 'directory'"):
        CheckpointManager(local, remote=remote)
    with CheckpointManager(local, remote=tmp_path / "elsewhere") as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
    with CheckpointManager(tmp_path / "elsewhere") as uploaded:
        assert uploaded.steps() == [1]


@pytest.mark.parametrize("flag", ["block", "alone"])
def test_save_flags_must_be_bools(tmp_path: Path, flag: str) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match=f"'{flag}' must be True or False"):
            mgr.save(1, {"w": torch.ones(3)}, **{flag: "no"})
        assert mgr.steps() == []


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        (
            {"policy": "every_n_steps", "planner_options": {"policy": "young", "mtbf_s": 5}},
            "must not hold 'policy'",
        ),
        ({"mtbf_s": 3600, "planner_options": {"mtbf_s": 5}}, "must not hold 'mtbf_s'"),
        (
            {"every_n_steps": 100, "planner_options": {"every_n_steps": 3}},
            "'every_n_steps' is given twice",
        ),
        ({"dirpath": 5}, "'dirpath' must be a directory path"),
        ({"dirpath": b"x"}, "'dirpath' must be a directory path"),
        ({"dirpath": ""}, "'dirpath' must be a directory path"),
    ],
)
def test_adapter_options_given_twice_or_of_the_wrong_kind_are_refused(
    kwargs: dict[str, Any], said: str
) -> None:
    """What the three adapters share: ``planner_options`` overrode the policy and MTBF given
    as arguments silently; a ``dirpath`` of the wrong type got a raw TypeError from pathlib
    (an empty one was the current directory) in the Accelerate and Trainer adapters."""
    kwargs.setdefault("dirpath", "ckpt")
    with pytest.raises(ConfigError, match=said):
        CheckpointOptions.check(**kwargs)


def test_a_dirpath_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        CheckpointOptions.check(dirpath=tmp_path / "file")


def test_a_remote_that_is_a_file_is_refused_by_name(tmp_path: Path) -> None:
    """It was accepted, and the run failed at its start with a StorageError "cannot list
    .../file: Not a directory" naming no argument."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"'remote' .* exists and is not a directory"):
        CheckpointOptions.check(dirpath=tmp_path / "ckpt", remote=tmp_path / "file")


def test_a_bad_steps_per_epoch_is_refused_when_the_options_are_checked() -> None:
    """``planner_options={"steps_per_epoch": -1}`` was accepted by the adapters' constructors
    and refused only when training started (or never, with another policy)."""
    for policy in ("epoch", "coci"):
        with pytest.raises(ConfigError, match="'steps_per_epoch' must be >= 1: -1"):
            CheckpointOptions.check(
                dirpath="ckpt", policy=policy, planner_options={"steps_per_epoch": -1}
            )


@pytest.mark.parametrize(
    "argv",
    [
        ["--loss", "'x'"],
        ["--loss", "k[0]"],
        ["--loss-csv", "BINARY"],
    ],
)
def test_a_loss_that_is_no_function_of_numbers_is_one_line(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "model.pt"
    binary.write_bytes(bytes(range(256)) * 8)
    argv = [str(binary) if a == "BINARY" else a for a in argv]
    common = ["--total-steps", "1000", "--step-time-s", "0.5", "--stall-s", "1", "--mtbf-s", "3600"]
    assert main(["simulate", *common, *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--loss" in err, err


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory"])
def test_a_loss_csv_that_is_no_regular_file_is_one_line_not_a_hang(
    tmp_path: Path, kind: str
) -> None:
    """`coci plan --loss-csv` of a device, a FIFO or a directory exits 2 with one line (before:
    /dev/zero was read without end, the FIFO waited for a writer for ever)."""
    path = {"/dev/zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "directory": str(tmp_path)}
    if kind == "fifo":
        os.mkfifo(path[kind])
    common = ["--total-steps", "1000", "--step-time-s", "0.5", "--stall-s", "1", "--mtbf-s", "3600"]
    command = module("coci_core.commands.cli", "plan", *common, "--loss-csv", path[kind])
    done = run(command, timeout_s=20)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "not a regular file" in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["out.txt", "plot", "missing/out.png"])
def test_a_plot_target_that_cannot_be_drawn_is_refused_first(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--plot out.txt`` was a matplotlib traceback after the report; ``--plot DIR`` said
    it drew DIR and wrote DIR.png."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    assert main(["report", str(tmp_path / "run"), "--plot", str(tmp_path / name)]) == 2
    assert "--plot" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "out.txt").exists()


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"seed": 2**64}, "'seed' must be an integer in"),
        ({"shuffle": "no"}, "'shuffle' must be True or False"),
        ({"drop_last": 1}, "'drop_last' must be True or False"),
    ],
)
def test_sampler_arguments_are_checked(kwargs: dict[str, Any], said: str) -> None:
    """``seed=2**64`` was accepted and the first epoch's permutation raised an overflow;
    ``shuffle="no"`` shuffled."""
    from coci_core import GlobalSampler

    with pytest.raises(ConfigError, match=said):
        GlobalSampler(10, num_replicas=1, rank=0, **kwargs)


def test_a_policy_name_that_is_no_string_is_refused() -> None:
    from coci_core.planner.policies import make_policy

    with pytest.raises(ConfigError, match="'policy' must be one of"):
        make_policy([])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "argv",
    [["ls", "DIR", "--remote", "MISSING"], ["ls", ""], ["ls", "bogus://x"], ["verify", ""]],
    ids=["remote-missing", "empty", "unknown-scheme", "verify-empty"],
)
def test_a_directory_that_cannot_be_read_is_one_line_exit_2(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``coci ls DIR --remote /nonexistent`` exited 0 without a word; an empty directory
    argument or an unknown URL scheme exited 1."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    names = {"DIR": str(tmp_path / "run"), "MISSING": str(tmp_path / "missing")}
    assert main([names.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("coci: ") and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"termination": ["x"]}, "'termination' must be an integer"),
        ({"termination": [1.5]}, "'termination' must be an integer"),
        ({"loss_breakpoints": None}, "'loss_breakpoints' must be a list of steps"),
        ({"loss_breakpoints": 5}, "'loss_breakpoints' must be a list of steps"),
    ],
)
def test_planner_lists_are_checked(kwargs: dict[str, Any], said: str) -> None:
    """``termination=[1.5]`` was truncated to rung 1 silently; ``["x"]`` and a breakpoint
    list that is no list were raw errors."""
    with pytest.raises(ConfigError, match=said):
        Planner(mtbf_s=3600, **kwargs)


def test_one_url_is_one_place_unless_its_options_name_another_server() -> None:
    """``remote=`` the directory's own URL is refused; the same URL with other options (another
    endpoint: one bucket name on two servers) is two places, and is not."""
    with pytest.raises(ConfigError, match="'remote' must be another place than 'directory'"):
        CheckpointManager("memory://args/run", remote="memory://args/run/")
    other = {"skip_instance_cache": True}  # as an endpoint_url would differ
    CheckpointManager(
        "memory://args/run", remote="memory://args/run", remote_storage_options=other
    ).close(upload_timeout_s=1)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"nodes": lambda step: -1.0}, "'nodes' must return numbers in"),
        ({"nodes": lambda step: float("nan")}, "'nodes' must return numbers in"),
        ({"nodes": lambda step: "4"}, "'nodes' must return numbers: '4'"),
        ({"nodes": lambda step: 1 / 0}, "'nodes' raised ZeroDivisionError at step 0"),
        ({"nodes": 10**10}, "'nodes' must be in"),
        ({"start_step": 2**63}, "'start_step' must be in"),
        ({"total_steps": 2**64}, "'total_steps' must be in"),
    ],
)
def test_a_failure_model_that_cannot_plan_is_refused_at_construction(
    kwargs: dict[str, Any], said: str
) -> None:
    """A ``nodes`` callable giving -1, NaN or a string, or raising, was accepted, and every
    re-plan then failed (logged once): no save was ever planned. (An adapter's options are
    checked before training starts: its callable is called when the planner is made, at the
    start of training, where it may read the process group.)"""
    with pytest.raises(ConfigError, match=said):
        Planner(mtbf_s=3600.0, **kwargs)
    if callable(kwargs.get("nodes")):
        CheckpointOptions.check(dirpath=None, mtbf_s=3600.0, planner_options=kwargs)
    assert Planner(mtbf_s=3600.0, nodes=lambda step: torch.tensor(4.0)).nodes is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mtbf_s": 1e308},
        {"default_mtbf_s": 1e308},
        {"mtbf_s": 1e-300, "nodes": lambda step: 1e9},
        {"mtbf_s": 1e308, "nodes": lambda step: 1e-300},
        {"start_step": 2**63 - 100},
        {"start_step": 2**62, "policy": "young"},
    ],
)
def test_extreme_but_valid_settings_plan_without_error(
    kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """An MTBF of 1e308 s made the planning horizon infinite, a run starting near the last
    int64 step overflowed the schedule: every re-plan failed (logged) instead of planning
    (here: no save, or a save at every step, as the extremes say)."""
    planner = Planner(stall_s=0.01, **kwargs)
    start = kwargs.get("start_step", 0)
    for step in range(start, start + 60):
        planner.observe(step, loss=1.0 / (1 + step - start), step_time_s=0.1)
        planner.should_save(step)
    assert "re-planning" not in caplog.text, caplog.text
    assert planner.replans >= 1 or start > 2**63 - 1000


@pytest.mark.parametrize(
    ("policies", "said"),
    [("", "names no policy"), (" , ", "names no policy"), ("young:foo", "only coci takes")],
)
def test_simulate_policies_that_name_nothing_are_refused(
    policies: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--policies ""`` printed an empty table and ``young:foo`` ignored ``:foo``."""
    common = ["--total-steps", "1000", "--step-time-s", "0.5", "--stall-s", "1", "--mtbf-s", "3600"]
    assert main(["simulate", *common, "--runs", "10", "--policies", policies]) == 2
    assert said in capsys.readouterr().err


def test_a_one_shot_schedule_beyond_the_planners_horizon_is_refused() -> None:
    """``plan_schedule(total_steps=10**8)`` ran for minutes and ``coci plan --total-steps
    100000000000`` failed allocating 745 GiB."""
    from coci_core.planner.schedule import plan_schedule

    with pytest.raises(ConfigError, match="'total_steps' - 'start_step' must be at most"):
        plan_schedule(
            total_steps=10**8,
            step_time_s=0.1,
            stall_s=1.0,
            persist_s=1.0,
            restart_s=1.0,
            mtbf_s=3600.0,
        )
    args = ["--step-time-s", "0.1", "--stall-s", "1", "--mtbf-s", "3600"]
    assert main(["plan", "--total-steps", "100000000000", *args]) == 2


def test_values_a_legitimate_caller_gives_are_accepted() -> None:
    """What the checks above must not refuse: a torch seed beyond 2**63 (``torch.seed()``
    gives them), a numpy float, and the Trainer adapter's ``every_n_steps`` given only in
    ``planner_options`` (it stands: the Trainer's ``save_steps`` does not override it)."""
    import numpy as np

    from coci_core import GlobalSampler
    from coci_transformers import CociCallback

    assert len(list(GlobalSampler(10, num_replicas=1, rank=0, seed=2**63 + 5))) == 10
    assert CompressionPolicy(mode="lossy", lossy_target=np.float64(0.01)).lossy_target == 0.01
    callback = CociCallback(policy="every_n_steps", planner_options={"every_n_steps": 200})
    assert callback.options.planner_options["every_n_steps"] == 200


def test_a_remote_url_fsspec_cannot_open_names_remote(tmp_path: Path) -> None:
    """``remote="gs://..."`` without gcsfs (here a scheme fsspec does not know) said
    ``'directory' is not a usable fsspec URL``: the local directory was fine."""
    with pytest.raises(ConfigError, match=r"^'remote' is not a usable fsspec URL: 'nope://b/x'"):
        CheckpointManager(tmp_path / "ckpt", remote="nope://b/x")
    with pytest.raises(ConfigError, match=r"^'directory' is not a usable fsspec URL"):
        CheckpointManager("nope://b/x")
    for malformed in ("://b/x", "s3:///x"):  # "://b/x" wrote into a local directory ":/b/x"
        with pytest.raises(ConfigError, match=rf"^'directory' is not a usable URL: '{malformed}'"):
            CheckpointManager(malformed)
        with pytest.raises(ConfigError, match=rf"^'remote' is not a usable URL: '{malformed}'"):
            CheckpointManager(tmp_path / "ckpt", remote=malformed)


@pytest.mark.parametrize("name", ["dirpath", "remote"])
@pytest.mark.parametrize("adapter", ["lightning", "accelerate", "transformers"])
def test_an_adapters_url_no_backend_opens_is_refused_when_made_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter: str, name: str
) -> None:
    """``dirpath="foo://..."`` (or ``gs://`` without gcsfs) was accepted when the adapter was
    made and refused once training started, as ``'directory'``: it is refused at once, naming
    the argument the user wrote; URLs of known schemes, chained or not, are taken."""
    from accelerate import Accelerator

    from coci_accelerate import CociCheckpointer
    from coci_lightning import CociCheckpoint
    from coci_transformers import CociCallback

    monkeypatch.chdir(tmp_path)
    makers = {
        "lightning": CociCheckpoint,
        "transformers": CociCallback,
        "accelerate": lambda **kw: CociCheckpointer(Accelerator(cpu=True), **kw),
    }
    make = makers[adapter]
    with pytest.raises(ConfigError, match=rf"^'{name}' is not a usable fsspec URL: 'nope://b/x'"):
        make(**{name: "nope://b/x"})
    for malformed in ("://b/x", "s3://", "s3:///x", "simplecache::s3:///x", "3s://b/x"):
        with pytest.raises(ConfigError, match=rf"^'{name}' is not a usable URL: '{malformed}'"):
            make(**{name: malformed})  # accepted, then failed (or wrote elsewhere) at training
    for url in ("simplecache::memory://b/x", "s3://b/x", "file:///b/x", "memory://", "http://h/x"):
        assert check_url(name, url) is None
    with pytest.raises(ConfigError, match=rf"^'{name}' is not a usable URL: 'http:///x'"):
        check_url(name, "http:///x")


def test_a_url_of_a_scheme_that_needs_no_host_is_taken_without_one(tmp_path: Path) -> None:
    """``hdfs:///run`` (the default name node) was refused as naming no bucket or host: only
    object stores and network protocols need one; a filesystem registered with fsspec whose
    URLs leave the host out is taken, and a manager saves and restores through it."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class NoHostFileSystem(MemoryFileSystem):
        protocol = ("cocinohost",)
        store: ClassVar[dict[str, Any]] = {}
        pseudo_dirs: ClassVar[list[str]] = [""]

    fsspec.register_implementation("cocinohost", NoHostFileSystem, clobber=True)
    assert check_url("dirpath", "cocinohost:///run") is None
    with pytest.raises(ConfigError, match=r"^'dirpath' is not a usable URL: 's3:///run'"):
        check_url("dirpath", "s3:///run")
    m = CheckpointManager("cocinohost:///run", keep_last=2)
    try:
        m.save(3, {"w": torch.arange(4.0)})
        m.wait()
        assert torch.equal(m.restore()["w"], torch.arange(4.0))
        assert m.last_restore is not None and m.last_restore.step == 3
    finally:
        m.close()
