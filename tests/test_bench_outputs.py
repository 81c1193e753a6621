"""bench/common.write_results: the JSON, and its copy in $OUT (the device machine's folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import write_results


def test_write_results_copies_into_out_once(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    path = write_results(tmp_path / "results" / "x.json", {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} == json.loads((out / "x.json").read_text())

    inside = write_results(out / "y.json", {"b": 2})  # already in $OUT: no copy onto itself
    assert inside == out / "y.json" and json.loads(inside.read_text()) == {"b": 2}

    monkeypatch.delenv("OUT")
    write_results(tmp_path / "results" / "z.json", {})
    assert not (out / "z.json").exists()
