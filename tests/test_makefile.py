"""The Makefile's set-up targets, read with `make -n` (nothing runs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    return subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_lab_serves_examples_on_loopback_from_the_virtualenv() -> None:
    out = dry_run("lab")
    (command,) = [line for line in out.splitlines() if "jupyter lab" in line]
    assert command.startswith(".venv/bin/python -m jupyter lab")
    assert "--ServerApp.ip=127.0.0.1" in command and "--ServerApp.root_dir=examples" in command


def test_browser_deps_installs_no_recommended_packages() -> None:
    out = dry_run("browser-deps")
    assert "apt-get install -y --no-install-recommends chromium" in out
