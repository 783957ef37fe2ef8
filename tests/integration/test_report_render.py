"""The reports render in a real browser: headless Chromium (Debian's package) opens the file.

Chromium runs with a fresh profile, no sandbox (containers), no GPU, and every network path
closed (no background networking, component updates or sync, and a host resolver that
resolves nothing): the reports are self-contained, and the test proves nothing is fetched.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.browser]  # chromium: .ci/bootstrap installs it; its absence fails

CHROMIUM_TIMEOUT_S = 90


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
            "--disable-default-apps", f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
            "--proxy-server=127.0.0.1:9", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S, check=False)


@pytest.fixture
def report(tmp_path) -> Path:
    from deploybench.report import write_html
    from tests.support.run_folders import make_run_folder

    return write_html(make_run_folder(tmp_path))


def test_run_report_renders_in_headless_chromium(report, tmp_path):
    dom = chromium(tmp_path, "--dump-dom", report.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    assert "<h1>deploybench run <code>deploybench_run/r1</code></h1>" in page
    for shown in ("Capacity search steps", "Overload ramp and recovery", "Preflight bandwidth", "Fan-out timeline",
                  "Per node: requests/s"):
        assert shown in page, shown
    assert page.count("<svg") >= 6

    shot = tmp_path / "shot.png"
    # every compositor stage before the frame is drawn, and a virtual-time budget to settle in: without them a
    # screenshot taken on a busy machine caught the page half painted (0.9 % coloured in one CI run, 1.7 % here)
    res = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2400",
                   "--run-all-compositor-stages-before-draw", "--virtual-time-budget=10000", report.as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[0] == 2400 and pixels.shape[1] == 1200
    # the plots are drawn: a good part of the page is neither white nor a flat colour
    coloured = (abs(pixels[..., 0] - pixels[..., 2]) > 0.2).mean()
    assert coloured > 0.01, coloured
