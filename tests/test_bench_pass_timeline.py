"""`bench/pass_timeline.py --tiny` end to end on the CPU: one entry per forward pass, matched to
the runtime's own pass count, in launch order, the class methods put back after. No timings
are compared to numbers."""

from __future__ import annotations

import json

import pytest

from bench.pass_timeline import main, parse_args
from bench.vs_vllm import TINY, make_workload
from lmnb.runtime import model_runner
from lmnb.runtime.scheduler import loop, scheduler


def test_tiny_run_has_one_entry_per_forward_pass(tmp_path, capsys):
    wrapped = [vars(scheduler.Scheduler)["_complete"], vars(model_runner.ModelRunner)["launch"],
               vars(model_runner.PendingStep)["result"], vars(loop.SchedulerThread)["_drain"]]
    output = tmp_path / "timeline.json"
    payload = main(["--tiny", "--device", "cpu", "--runs", "3", "--profile",
                    "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(payload, default=str))
    assert wrapped == [vars(scheduler.Scheduler)["_complete"],
                       vars(model_runner.ModelRunner)["launch"],
                       vars(model_runner.PendingStep)["result"],
                       vars(loop.SchedulerThread)["_drain"]]  # put back

    work = make_workload("prefix-ids", TINY, 128256)
    runs = payload["runs"]
    assert len(runs) == 2  # the warm-up is not reported
    for run in runs:
        passes = run["passes"]
        assert len(passes) == run["forward_passes"] >= 2
        assert [p["index"] for p in passes] == list(range(len(passes)))
        assert {p["mode"] for p in passes} == {"EXTEND", "DECODE"}
        assert passes[0]["mode"] == "EXTEND" and passes[0]["prefix_tokens"] == 0
        extend = [p for p in passes if p["mode"] == "EXTEND"]
        decode = [p for p in passes if p["mode"] == "DECODE"]
        # the groups share their prefixes: fewer new tokens than prompt tokens
        assert sum(p["new_tokens"] for p in extend) < sum(map(len, work.prompts))
        assert all(p["new_tokens"] == p["requests"] == len(work.prompts) for p in decode)
        assert run["counts"]["output_tokens"] == sum(work.max_tokens)
        assert len(extend) + len(decode) == len(passes)
        for p in passes:  # every pass planned, launched, waited for and completed
            assert all(p[key] is not None and p[key] >= 0
                       for key in ("plan_ms", "launch_ms", "wait_ms", "complete_ms"))
            # (the last pass's `_complete` may end after `generate` returned: its KV goes to
            # the cache once the outputs are sent)
            assert p["launch_at_ms"] <= p["completed_at_ms"] and p["launch_at_ms"] <= run["wall_ms"]
        assert [p["launch_at_ms"] for p in passes] == sorted(p["launch_at_ms"] for p in passes)
        assert run["first_launch_ms"] == passes[0]["launch_at_ms"]
        assert run["loop_calls"]["Scheduler.step"] >= len(passes)
    assert payload["profile"]["passes"] == runs[-1]["forward_passes"]
    assert payload["config"]["workload"] == "prefix-ids" and payload["info"]["device"] == "cpu"
    out = capsys.readouterr().out
    assert out.count("\nrun ") == 2 and "EXTEND" in out


def test_arguments():
    args = parse_args(["--tiny", "--device", "cpu"])
    assert args.model == "tiny-llama-3" and args.sizes is TINY and args.backend is None
    assert parse_args(["--device", "cpu", "--backend", "triton"]).model == "llama-3-8b"
    for bad in (["--runs", "1"], ["--workload", "nope"], ["--tiny", "--device", "cpu",
                                                          "--extend-capture"],
                ["--capture-passes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
