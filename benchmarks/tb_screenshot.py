"""Draw docs/img/coci-tab.png: ``coci demo``'s run in TensorBoard's coci tab, in headless Chromium.

Run from the repository root (needs the dev extra, chromium and chromedriver, as ``.ci/run``
installs them)::

    python -m benchmarks.tb_screenshot            # writes docs/img/coci-tab.png
    python -m benchmarks.tb_screenshot --dir D    # keeps the demo's files in D (run again
                                                  # with the same D: redraws, no new demo)

It runs ``coci demo`` (a Lightning run killed with SIGKILL and resumed), starts TensorBoard on
the log directory the demo prints, opens the coci tab and saves the screenshot; the same
timeline drawn with matplotlib (``coci report --plot``) goes to docs/img/coci-report-plot.png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.harness.tb import open_browser, open_coci_tab, start_tensorboard

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tb_screenshot")
    parser.add_argument("--dir", help="the demo's directory (default: a new temporary one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "coci-tab.png"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "img" / "coci-report-plot.png"))
    parser.add_argument("--total-steps", type=int, default=600)
    parser.add_argument("--kill-step", type=int, default=330)
    args = parser.parse_args(argv)
    demo = Path(args.dir or tempfile.mkdtemp(prefix="coci-tab-"))
    cli = [sys.executable, "-m", "coci_core.commands.cli"]
    if not (demo / "run" / "coci" / "telemetry.jsonl").is_file():
        steps = ["--total-steps", str(args.total_steps), "--kill-step", str(args.kill_step)]
        subprocess.run([*cli, "demo", "--dir", str(demo), *steps], check=True)
    subprocess.run([*cli, "report", str(demo / "run" / "coci"), "--plot", args.plot], check=True)
    server = start_tensorboard(demo / "run", demo / "tensorboard.log")
    try:
        with open_browser(width=1400, height=1180) as driver:
            open_coci_tab(driver, server.url)
            driver.switch_to.default_content()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
    finally:
        server.stop()
    print(f"wrote {args.out} and {args.plot} (demo files in {demo})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
