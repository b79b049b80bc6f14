"""`coci --help` through the installed package loads no torch, Lightning or Accelerate (it
answers in a fraction of a second); the package's names still import."""

from __future__ import annotations

from tests.harness.processes import run, script


def test_help_through_the_package_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from coci_core.commands.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "heavy = ('torch', 'numpy', 'scipy', 'lightning', 'pytorch_lightning', 'accelerate')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = run(script(code), timeout_s=60, check=True).stdout
    assert "usage: coci" in out
    assert out.strip().splitlines()[-1] == "[]"


def test_package_names_resolve() -> None:
    import coci_core

    for name in coci_core.__all__:
        assert getattr(coci_core, name) is not None, name
    assert "CheckpointManager" in dir(coci_core)
