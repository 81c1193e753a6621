"""What a live `TokenView` costs a running program: 10,000 streamed tokens on a tiny model.

A program of `--gens` gens of `--tokens-per-gen` tokens each (`ignore_eos`) runs on a CPU
Runtime whose model is a 2-layer, 64-wide random Llama with SmolLM2's tokenizer (a model that
costs little, so that the host's share — where a view's updates compete — is as large as it
gets). Three paths, alternated `--repeats` times; the fastest run of each is compared (the
medians are reported too: on a shared machine other work slows runs at random):

- `plain`: the program as usual;
- `traced`: `token_view=True` (every gen asks for token origins and top-5 logprobs), no view;
- `view`: traced, with a `TokenView` attached and updating live (its throttle thread at 10 Hz,
  each update's rows also serialized to JSON as the widget's comm would send them).

The view's overhead is `view / traced - 1` (its update path) and the whole feature's
`view / plain - 1`; both should stay under 5%. The view also reports its own update time (CPU
work on its thread, JSON included) as a share of the run's wall time: the same cost measured
without the noise of comparing two runs. JSON goes to bench/results/token_view.json.

    python bench/token_view.py                     # 10 gens x 1000 tokens, 3 repeats
    python bench/token_view.py --gens 4 --tokens-per-gen 250 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `lmnb` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, environment, format_table, write_json  # noqa: E402
from lmnb.widgets.token_view import MAX_FLUSH_SHARE  # noqa: E402

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=16384, bos_token_id=1,
            eos_token_id=2, rms_norm_eps=1e-5, dtype="float32")
BUDGET = 0.05


def make_program(gens: int, tokens: int) -> Any:
    import lmnb

    @lmnb.function
    def long_text(s):
        s += "A long story, told in parts.\n"
        for i in range(gens):
            s += f"\nPart {i + 1}:" + lmnb.gen(f"part{i}", max_tokens=tokens, ignore_eos=True,
                                               temperature=1.0, seed=i)

    return long_text


def run_once(program: Any, backend: Any, mode: str) -> dict[str, Any]:
    from lmnb.widgets import TokenView

    start = time.perf_counter()
    state = program.run(backend=backend, stream=True, token_view=mode != "plain")
    view = None
    if mode == "view":
        view = TokenView(state, hz=10.0)
        # the widget's comm would serialize every update of its rows
        view.observe(lambda change: json.dumps(change["new"]), names=["rows", "live"])
    state.sync()
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": seconds, "tokens": sum(
        meta["completion_tokens"] for meta in state.executor.meta_info.values())}
    if view is not None:  # its updates while the program ran; then its final state
        out.update(flushes=view.flushes, flush_seconds=view.flush_seconds)
        view.refresh()
        out["shown_generated"] = view.counts["generated"]
        view.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gens", type=int, default=10)
    parser.add_argument("--tokens-per-gen", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2)")
    parser.add_argument("--out", default=str(RESULTS_DIR / "token_view.json"))
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    from lmnb.lang.backends.local import LocalBackend
    from lmnb.runtime.engine import Runtime
    from lmnb.runtime.models import loader

    hf_logging.set_verbosity_error()
    tokenizer_dir = loader.resolve_model_dir(args.tokenizer)
    # random tokens re-tokenize into more ids: room for the prompts to grow past the outputs
    context = 2 * args.gens * (args.tokens_per_gen + 16) + 256
    with tempfile.TemporaryDirectory(prefix="lmnb-token-view-") as scratch:
        folder = Path(scratch) / "tiny"
        folder.mkdir()
        config = {**TINY, "vocab_size": len(loader.load_tokenizer(tokenizer_dir)),
                  "max_position_embeddings": max(context, 2048)}
        (folder / "config.json").write_text(json.dumps(config))
        runtime = Runtime(str(folder), tokenizer_path=str(tokenizer_dir), load_format="dummy",
                          device="cpu", dtype="float32", max_total_tokens=context + 1024,
                          context_length=max(context, 2048))
    try:
        backend = LocalBackend(runtime)
        program = make_program(args.gens, args.tokens_per_gen)
        make_program(1, 8).run(backend=backend, token_view=True)  # warm-up
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "traced": [], "view": []}
        for _ in range(args.repeats):
            for mode in runs:
                runtime.flush_cache()
                runs[mode].append(run_once(program, backend, mode))
    finally:
        runtime.close()

    median = {mode: statistics.median(r["seconds"] for r in rs) for mode, rs in runs.items()}
    best = {mode: min(r["seconds"] for r in rs) for mode, rs in runs.items()}
    view_runs = runs["view"]
    rows = [[mode, best[mode], median[mode], rs[0]["tokens"], rs[0]["tokens"] / best[mode]]
            for mode, rs in runs.items()]
    print(format_table(["path", "seconds (best)", "seconds (median)", "tokens", "tokens/s"],
                       rows))
    view_overhead = best["view"] / best["traced"] - 1
    feature_overhead = best["view"] / best["plain"] - 1
    flushes = statistics.median(r["flushes"] for r in view_runs)
    flush_seconds = statistics.median(r["flush_seconds"] for r in view_runs)
    flush_share = statistics.median(r["flush_seconds"] / r["seconds"] for r in view_runs)
    print(f"\nview updates: {flushes:.0f} per run, {flush_seconds:.3f} s of updating in all "
          f"({100 * flush_share:.1f}% of the run's wall time); "
          f"{view_runs[0]['shown_generated']:,} generated tokens shown")
    print(f"view vs traced (the view's update path): {100 * view_overhead:+.1f}%  "
          f"{'OK' if view_overhead <= BUDGET else 'OVER'} (budget {100 * BUDGET:.0f}%)")
    print(f"view vs plain (the whole feature):        {100 * feature_overhead:+.1f}%  "
          f"{'OK' if feature_overhead <= BUDGET else 'OVER'}")
    path = write_json(args.out, {
        "benchmark": "token_view", "environment": environment("cpu"), "args": vars(args),
        "model": TINY, "runs": runs, "median_seconds": median, "best_seconds": best,
        "view_update_share": flush_share, "view_update_budget": MAX_FLUSH_SHARE,
        "view_overhead": view_overhead, "feature_overhead": feature_overhead,
        "budget": BUDGET, "view_flushes": flushes, "view_flush_seconds": flush_seconds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
