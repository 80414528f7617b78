"""The report's HTML opens offline in a real browser: headless Chromium renders it to a non-blank screenshot."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")  # Pillow comes with matplotlib

from memplan.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: a rendered page with tables, text and plots has thousands of colours (anti-aliased text, plot lines);
#: a blank or error page has a handful
MIN_COLOURS = 200


def distinct_colours(path: Path) -> int:
    with Image.open(path) as img:
        return len(img.convert("RGB").getcolors(maxcolors=1 << 24))


def test_distinct_colours_of_a_toy_image(tmp_path):
    """Worked by hand: a 3×1 image with red, blue, red has 2 colours."""
    img = Image.new("RGB", (3, 1))
    img.putdata([(255, 0, 0), (0, 0, 255), (255, 0, 0)])
    img.save(tmp_path / "toy.png")
    assert distinct_colours(tmp_path / "toy.png") == 2


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_html_renders_in_headless_chromium(tmp_path):
    out = tmp_path / "report"
    assert main(["report", "--model", "qwen3-0.6b", "--seq", "2048", "--gpus", "8", "--zero", "3",
                 "--gpu", "a100-80g", "--out", str(out), "--name", "page"]) == 0
    shot = tmp_path / "shot.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,900",
           (out / "page.html").resolve().as_uri()]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert shot.exists(), proc.stderr[-2000:]
    with Image.open(shot) as img:
        assert img.size == (1200, 900)
    assert distinct_colours(shot) > MIN_COLOURS
