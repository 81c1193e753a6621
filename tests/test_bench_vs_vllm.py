"""bench/vs_vllm.py without an engine: the workloads' shapes and determinism, the comparison
table, the arguments and the children's command lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import vs_vllm
from bench.offline import make_workload as offline_workload
from bench.vs_vllm import FULL, DecodeSteps, Requests, make_workload

VOCAB = 128256


def _groups(prompts: list, size: int) -> list[list]:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def test_workloads_are_shaped_as_specified_and_deterministic() -> None:
    work = {name: make_workload(name, FULL, VOCAB) for name in vs_vllm.WORKLOADS}
    assert all(make_workload(name, FULL, VOCAB).digest() == w.digest()
               for name, w in work.items())
    assert len({w.digest() for w in work.values()}) == len(work)

    offline = work["offline"]
    nano = offline_workload(num_seqs=256, min_input_len=100, max_input_len=1024,
                            min_output_len=100, max_output_len=1024, vocab_size=VOCAB)
    assert isinstance(offline, Requests) and offline.temperature == 0.6
    assert offline.prompts == nano.prompts and offline.max_tokens == nano.output_lens

    for name, groups, per_group, shared, tail, out in (("prefix-ids", 8, 32, 1500, 40, 16),
                                                       ("fork", 64, 4, 600, 32, 64)):
        w = work[name]
        assert isinstance(w, Requests) and w.temperature == 0.0 and not w.is_text
        assert len(w.prompts) == groups * per_group and set(w.max_tokens) == {out}
        assert all(len(p) == shared + tail for p in w.prompts)
        heads = [{tuple(p[:shared]) for p in g} for g in _groups(w.prompts, per_group)]
        assert all(len(h) == 1 for h in heads)  # one prefix per group ...
        assert len(set().union(*heads)) == groups  # ... a different one in each group
        assert all(len({tuple(p[shared:]) for p in g}) == per_group
                   for g in _groups(w.prompts, per_group))
        assert max(max(p) for p in w.prompts) < vs_vllm.MAX_PROMPT_ID

    text = work["prefix-text"]
    assert isinstance(text, Requests) and text.is_text and len(text.prompts) == 256
    prefixes = [p.split("\n\n")[0] for p in text.prompts]
    assert all(len(p.split()) == 1400 for p in prefixes)
    assert [len(set(g)) for g in _groups(prefixes, 32)] == [1] * 8 and len(set(prefixes)) == 8
    assert len(set(text.prompts)) == 256 and set(text.max_tokens) == {16}

    for name, batch, length, steps in (("decode-b64", 64, 512, 128), ("decode-b1", 1, 128, 256)):
        w = work[name]
        assert isinstance(w, DecodeSteps) and (w.first, w.steps) == (16, steps)
        assert len(w.prompts) == batch and all(len(p) == length for p in w.prompts)
        assert len({p[0] for p in w.prompts}) == batch  # no prefix shared within the batch


def _requests_cell(seconds: float, digest: str = "d", **counts: int) -> dict:
    base = {"prompt_tokens": 100, "output_tokens": 40, "expected_output_tokens": 40}
    return {"kind": "requests", "label": "offline", "digest": digest, "seconds": seconds,
            "tokens_per_s": 40 / seconds, **base, **counts}


def test_comparison_rows_ratio_and_mismatches() -> None:
    decode = {"kind": "decode", "label": "decode b1", "digest": "x", "step_ms": 8.0,
              "tokens_per_s": 125.0, "prompt_tokens": 5, "output_tokens": 9,
              "expected_output_tokens": 9}
    runs = {"vllm": {"start": {"seconds": 60.0},
                     "workloads": {"offline": _requests_cell(2.0), "decode-b1": decode,
                                   "fork": _requests_cell(1.0)}},
            "lmnb": {"start": {"seconds": 30.0},
                     "workloads": {"offline": _requests_cell(1.0),
                                   "decode-b1": {**decode, "step_ms": 10.0},
                                   "fork": _requests_cell(1.0, digest="other",
                                                          output_tokens=39)}}}
    rows, notes = vs_vllm.comparison_rows("llama-3-8b", runs, ["offline", "decode-b1", "fork"])
    assert [r[0] for r in rows] == ["engine start", "offline", "decode b1", "offline (!)"]
    assert [r[-1] for r in rows] == ["2.00x", "2.00x", "0.80x", "1.00x"]
    assert rows[2][2] == "ms/step" and rows[1][2] == "s"
    assert len(notes) == 1 and "digests differ" in notes[0] and "39 of 40" in notes[0]

    rows, notes = vs_vllm.comparison_rows(
        "m", {"lmnb": runs["lmnb"], "vllm": {"workloads": {"offline": {"error": "boom"}},
                                             "child_error": "exited with 1"}}, ["offline"])
    assert rows[1][3] is None and rows[1][-1] is None and rows[1][4] == "1.000"
    assert any("vLLM failed: boom" in n for n in notes)
    assert any("exited with 1" in n for n in notes)
    assert vs_vllm.speed_ratio(None, 1.0) is None and vs_vllm.speed_ratio(3.0, 1.5) == 2.0


def test_arguments_and_per_model_workloads() -> None:
    args = vs_vllm.parse_args(["--tiny", "--skip-vllm"])
    assert args.models == [vs_vllm.TINY_MODEL] and args.sizes is vs_vllm.TINY
    assert args.workloads is None and args.repeats == 3
    assert vs_vllm.parse_args(["--workloads", "all"]).workloads == list(vs_vllm.WORKLOADS)
    for bad in (["--repeats", "0"], ["--workloads", "offline,nope"], ["--models", "gpt-9"],
                ["--engine", "lmnb"], ["--engine", "lmnb", "--models", "llama-3-8b",
                                       "--skip-vllm"],
                ["--json-out", "x.json"], ["--gpu-memory-utilization", "1.5"]):
        with pytest.raises(SystemExit):
            vs_vllm.parse_args(bad)

    assert vs_vllm.model_workloads("llama-2-7b", None, 32000, VOCAB)[0] == ["offline"]
    names, notes = vs_vllm.model_workloads("llama-2-7b", ["prefix-text", "fork"], 32000, VOCAB)
    assert names == ["fork"] and "prefix-text skipped" in notes[0]
    assert vs_vllm.model_workloads("llama-3-8b", None, VOCAB, VOCAB) == (
        list(vs_vllm.WORKLOADS), [])


def test_children_command_lines_and_environment(tmp_path: Path) -> None:
    args = vs_vllm.parse_args(["--lmnb-backend", "triton", "--profile", "--repeats", "2"])
    for engine in vs_vllm.ENGINES:
        command = vs_vllm.child_command(engine, "llama-3-8b", tmp_path, ["offline", "fork"],
                                        tmp_path / "out.json", args)
        child = vs_vllm.parse_args(command[2:])  # what the child process parses
        assert (child.engine, child.models, child.model_dir) == (engine, ["llama-3-8b"], tmp_path)
        assert child.workloads == ["offline", "fork"] and child.repeats == 2
        assert child.profile
        assert child.lmnb_backend == ("triton" if engine == "lmnb" else None)

    site = tmp_path / "site"
    site.mkdir()
    env = vs_vllm.child_env(site, {"PYTHONPATH": "/elsewhere", "PATH": "/bin"})
    assert env["PYTHONPATH"].split(":") == [str(vs_vllm.REPO_ROOT), str(site), "/elsewhere"]
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1"
    assert vs_vllm.child_env(tmp_path / "missing", {})["PYTHONPATH"] == str(vs_vllm.REPO_ROOT)


def test_cold_caches_give_each_engine_empty_compile_caches(tmp_path: Path) -> None:
    assert vs_vllm.parse_args(["--cold-caches"]).cold_caches
    assert not vs_vllm.parse_args([]).cold_caches
    base = {"PATH": "/bin", "TRITON_CACHE_DIR": "/warm/triton"}
    envs = [vs_vllm.cold_cache_env(base, tmp_path / engine) for engine in vs_vllm.ENGINES]
    for env, engine in zip(envs, vs_vllm.ENGINES, strict=True):
        assert env["PATH"] == "/bin"
        for name in vs_vllm.COMPILE_CACHE_VARIABLES:
            folder = Path(env[name])
            assert folder.is_dir() and not any(folder.iterdir())
            assert folder.is_relative_to(tmp_path / engine)
    assert base["TRITON_CACHE_DIR"] == "/warm/triton"  # the parent's own is untouched
    assert {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT",
            "FLASHINFER_WORKSPACE_BASE"} <= set(vs_vllm.COMPILE_CACHE_VARIABLES)
