# One command each: `make demo` trains, `make test` runs the suite (what CI runs), `make bench-dp` measures.
# The CPU build of torch is pinned here (a plain `torch` would pull a multi-GB CUDA build); on a GPU
# machine install your CUDA torch into the venv first and run `make TORCH_SPEC= setup`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.trainmesh-installed

.PHONY: setup demo test test-slow test-all equivalence bench bench-dp bench-tp bench-zero bench-pp bench-pp4 bench-plan bench-window bench-cp bench-documents bench-moe bench-data bench-multinode bench-recovery bench-replicas clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(BIN)/python -m pip install -q "$(TORCH_SPEC)")
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/trainmesh train --nproc 2 --dp 2 --model tiny --steps 150 --global-batch 32 --eval-every 50

test: setup
	$(BIN)/python -m pytest -m "not slow" -q --durations=10

# The cases marked slow (larger worlds, longer runs, the network-namespace bed): CI runs them after `make test`.
test-slow: setup
	$(BIN)/python -m pytest -m slow -q --durations=10

test-all: setup
	$(BIN)/python -m pytest -q --durations=10

# Every layout's float64 equivalence test (slow ones included) and the table of its margins vs one process.
equivalence: setup
	$(BIN)/python -m pytest -q -k "single_process or one_process or divides_nothing or composes_with or planted or every_zero_stage" tests

# Every form beside its torch peer, one launch each: median (min-max) ratio over 35 timed pairs of steps,
# peak RSS per side; the table also lands in runs/<timestamp>/results.md and results.json.
bench: setup
	$(BIN)/trainmesh bench all --nproc 2 --model small --global-batch 16

bench-dp: setup
	$(BIN)/trainmesh bench dp --nproc 2 --dp 2 --model small --global-batch 16 --microbatches 2

bench-tp: setup
	$(BIN)/trainmesh bench tp --nproc 2 --tp 2 --model small --global-batch 16

# Context parallelism on `small` at cp 1, 2, 4: activation bytes, peak RSS and counted cp bytes per rank at
# 4096 tokens vs the planner and the byte formulas; the longest sequence under 128 MiB per rank (planner vs
# measured) and tokens/s there; the ring's hidden communication from its timeline; torch's context_parallel.
bench-cp: setup
	$(BIN)/python -m trainmesh_bench.cp --seq-len 4096

# The cp2 ring over packed documents (4096 tokens, documents of 256-1024): per-rank attention compute with the
# shards balanced by counted attention blocks vs the head-tail pair, and each one's distance from perfect balance.
bench-documents: setup
	$(BIN)/python -m trainmesh_bench.documents --seq-len 4096 --cp 2

# Expert parallelism on moe-tiny at ep 1, 2, 4 (4 ranks): counted all-to-all bytes per step vs the formula,
# tokens/s and peak RSS per rank; then the experts' padded batched GEMM vs a per-expert loop.
bench-moe: setup
	$(BIN)/python -m trainmesh_bench.moe

# ZeRO-3 over 4 ranks vs HSDP 2x2 on 2 network-namespace "nodes" over a 200 Mbit/s tbf link (needs root, ip,
# tc, unshare): bytes that crossed the node link per step (counted on the veths, and by formula), step time.
bench-multinode: setup
	$(BIN)/python -m trainmesh_bench.multinode --rate-mbit 200

# Replica groups through torchft on the bed: node 1's group killed mid-run; the survivor's seconds from the kill
# to its next trained step and the steps it gave up (make bench-recovery shows the same column beside the restarts).
bench-replicas: setup
	$(BIN)/python -m trainmesh_bench.replicas --rate-mbit 200

# kill -> next trained step and steps lost, per recovery mode, on the namespace bed (root, ip, tc)
bench-recovery: setup
	$(BIN)/python -m trainmesh_bench.recovery --rate-mbit 200

bench-zero: setup
	$(BIN)/trainmesh bench zero --nproc 2 --dp 2 --model small --global-batch 16

bench-pp: setup
	$(BIN)/trainmesh bench pp --nproc 2 --pp 2 --model small --global-batch 16 --microbatches 8

bench-pp4: setup
	$(BIN)/trainmesh bench pp --nproc 4 --pp 4 --model small-deep --global-batch 16 --microbatches 8

bench-plan: setup
	$(BIN)/python -m trainmesh_bench.plan --model small

bench-window: setup
	$(BIN)/python -m trainmesh_bench.window

# prepare tokens/s (1 and 2 workers), loader vs training tokens/s, trainer RSS vs corpus size; data in /tmp.
# Sizes: make bench-data BENCH_DATA_ARGS="--large-gb 4"
BENCH_DATA_ARGS ?=
bench-data: setup
	$(BIN)/python -m trainmesh_bench.data $(BENCH_DATA_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
