"""The benchmark pages' plots are drawn from the results files by benchmarks/plots.py."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks import plots

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_results_file_draws_its_committed_plot(tmp_path: Path) -> None:
    """The script draws one SVG per results file, the same set as the committed plots, each a
    valid SVG with labelled axes."""
    written = plots.draw_all(plots.RESULTS, tmp_path)
    stems = {p.stem for p in written}
    assert stems == {p.stem for p in plots.RESULTS.glob("*.json")} == set(plots.PLOTS)
    assert stems == {p.stem for p in plots.OUT.glob("*.svg")}
    for path in written:
        root = ET.parse(path).getroot()
        assert root.tag.endswith("svg")
        text = path.read_text()
        assert "(s)" in text or "(%" in text  # units in the axis labels


def test_a_rerun_writes_the_same_files(tmp_path: Path) -> None:
    first = {p.name: p.read_bytes() for p in plots.draw_all(plots.RESULTS, tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in plots.draw_all(plots.RESULTS, tmp_path / "b")}
    assert first == second


def test_every_image_and_results_link_in_the_docs_exists() -> None:
    pages = list(DOCS.glob("*.md"))
    links = [
        (page, target)
        for page in pages
        for target in re.findall(r"\]\(((?:img|results)/[^)\s]+)\)", page.read_text())
    ]
    assert len(links) >= 6
    missing = [(page.name, target) for page, target in links if not (DOCS / target).exists()]
    assert not missing
