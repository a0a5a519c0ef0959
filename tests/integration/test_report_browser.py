"""report.html as a person sees it: rendered by headless Chromium, every plot decoded, the page not blank."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADINGS = (
    "Summary",
    "Evaluation",
    "Loss",
    "Merged tokens and chaos events",
    "Learner incarnations",
    "Rounds: quorum and grace",
    "Staleness",
    "Traffic",
    "Supervised fine-tuning",
)
# After load, write every image's decoded size into the DOM so --dump-dom shows whether it rendered.
PROBE = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
    "Array.from(document.images).map(i => i.naturalWidth + 'x' + i.naturalHeight).join(',')));</script>"
)

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian `chromium` is not installed (apt-get install chromium); CI installs it"
)


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


@needs_chromium
def test_report_page_loads_with_headings_and_decoded_plots(posttrained_runs, tmp_path):
    page = Path(posttrained_runs.report["paths"]["html"])
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    out = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", probed.as_uri())
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    assert re.search(r"<h1>ddiloco run report — k1</h1>", dom)
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in dom, heading
    sizes = re.search(r'data-images="([^"]*)"', dom)
    assert sizes, "the load event never fired"
    dims = [tuple(map(int, s.split("x"))) for s in sizes.group(1).split(",")]
    assert len(dims) >= 8 and all(w >= 300 and h >= 150 for w, h in dims), dims


@needs_chromium
def test_report_screenshot_is_not_blank(posttrained_runs, tmp_path):
    from matplotlib.image import imread

    page = Path(posttrained_runs.report["paths"]["html"])
    shot = tmp_path / "report.png"
    out = chromium(tmp_path, "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri())
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    rgb = (imread(shot)[..., :3] * 255).round().astype(np.int16)  # (H, W, 3)
    assert rgb.shape[:2] == (2400, 1280)
    non_white = (rgb < 245).any(axis=-1).mean()
    assert non_white > 0.05, f"only {non_white:.1%} of the page is drawn on"
    # matplotlib's first line colour (#1f77b4) appears only in the plots: they were painted, not just laid out.
    blue = (np.abs(rgb - np.array([31, 119, 180])).max(axis=-1) <= 12).sum()
    assert blue > 2000, f"{blue} plot-blue pixels"
