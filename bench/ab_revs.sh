#!/usr/bin/env bash
# One command timed over several commits' `lmnb` in one device call, runs interleaved: for a
# suspected regression (or a gain) that only shows side by side on the same machine, since rows
# drift between leases.
#
# The device machine's copy of the tree has no git history, so each commit's `lmnb` and
# `bench` are written here first (git-ignored, a few MB: carry them), then the command runs
# once per commit and round from that commit's folder: its own scripts and package (the bench
# scripts put their own tree first on sys.path), so the options must be ones every commit's
# script takes.
#
#   bash bench/ab_revs.sh prepare 93d2f71 HEAD       # here: .gpu/ab/<rev>/{lmnb,bench}
#   # device call, carry [".gpu/ab", ".gpu/tokenizer-llama3", ...]:
#   ROUNDS=3 bash bench/ab_revs.sh run -- python bench/vs_vllm.py --skip-vllm \
#       --tokenizer-dir {root}/.gpu/tokenizer-llama3 --models llama-3-8b \
#       --workloads decode-b64 --repeats 3 --lmnb-backend triton --output {out}/ab-{rev}-{round}.json
#
# Replaced per run: `{rev}`, `{round}`, `{root}` (the working tree) and `{out}` ($OUT, else
# /tmp); each run's output follows an `== rev R, round N` line. Env: ROUNDS (default 2), AB_DIR
# (default .gpu/ab). The JSON's git_commit is where git finds a repository (none on the device).
set -euo pipefail
cd "$(dirname "$0")/.."
AB_DIR=${AB_DIR:-.gpu/ab}

case "${1:-}" in
  prepare)
    shift
    [ $# -ge 1 ] || { echo "ab_revs: prepare REV [REV...]" >&2; exit 2; }
    rm -rf "$AB_DIR"
    for rev in "$@"; do
      sha=$(git rev-parse --short "$rev")
      mkdir -p "$AB_DIR/$sha"
      git archive "$sha" lmnb bench | tar -x -C "$AB_DIR/$sha"
      echo "$rev -> $AB_DIR/$sha ($(du -sh "$AB_DIR/$sha" | cut -f1))"
    done
    ;;
  run)
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || { echo "ab_revs: run -- COMMAND..." >&2; exit 2; }
    revs=$(ls "$AB_DIR")
    [ -n "$revs" ] || { echo "ab_revs: nothing in $AB_DIR (run prepare here first)" >&2; exit 1; }
    root=$PWD
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for rev in $revs; do
        echo "== rev $rev, round $round"
        args=()
        for arg in "$@"; do
          arg=${arg//\{rev\}/$rev}
          arg=${arg//\{round\}/$round}
          arg=${arg//\{root\}/$root}
          arg=${arg//\{out\}/${OUT:-/tmp}}
          args+=("$arg")
        done
        (cd "$AB_DIR/$rev" && "${args[@]}")
      done
    done
    ;;
  *)
    echo "ab_revs: prepare REV [REV...] | run -- COMMAND..." >&2
    exit 2
    ;;
esac
