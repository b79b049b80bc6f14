"""Package-level promises: the public API and the layering of core and adapters."""

from __future__ import annotations

import coci_core
from tests.harness.processes import run, script


def test_core_imports_no_host_framework() -> None:
    """Importing coci_core (and its CLI) in a fresh interpreter loads neither Lightning nor
    Accelerate."""
    code = (
        "import sys, coci_core, coci_core.commands.cli, coci_core.commands.demo; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'accelerate')]; print(bad)"
    )
    out = run(script(code), check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_is_exactly_all() -> None:
    """Every public name of coci_core is in __all__ and every name in __all__ exists."""
    public = {n for n in dir(coci_core) if not n.startswith("_")}  # lazy names included
    modules = {n for n in public if type(getattr(coci_core, n)).__name__ == "module"}
    assert set(coci_core.__all__) == public - modules
    assert sorted(coci_core.__all__) == list(coci_core.__all__)
