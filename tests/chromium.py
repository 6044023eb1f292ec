"""Debian's Chromium, headless, as the tests drive it: the DOM it built from a page, the console
messages the page logged, and a screenshot (the bench's HTML reports, the status page)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONSOLE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-proxy-server"]
"""As root, on a machine with no way out: without the background-networking flags Chromium
keeps trying hosts it cannot reach."""


def render(page: Path | str, profile_dir: Path) -> tuple[str, list[str]]:
    """The DOM Chromium built from ``page`` (a file or a URL) and the console messages it logged."""
    assert CHROMIUM is not None, "CI must have chromium (.ci/run installs it)"
    url = page.resolve().as_uri() if isinstance(page, Path) else page
    p = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile_dir / 'chromium'}", "--enable-logging=stderr",
         "--v=0", "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, [m.group(1) for m in CONSOLE.finditer(p.stderr)]


def screenshot(url: str, out: Path, profile_dir: Path, size: str = "1100,1500") -> None:
    assert CHROMIUM is not None
    p = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile_dir / 'chromium'}",
                        f"--window-size={size}", "--hide-scrollbars", f"--screenshot={out}", url],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and out.exists(), p.stderr[-2000:]
