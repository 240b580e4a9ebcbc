# Two commands do all the set-up: `make demo` and `make test` each build the project-local
# virtual environment on first use (.venv), then run.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gptpar-installed
# DeepSpeed JIT-builds its CPU communication op into torch's extensions folder: `import gptpar` makes that
# <venv>/torch_extensions unless TORCH_EXTENSIONS_DIR is set (gptpar/extensions_dir.py), for make and for the
# commands typed by hand alike, so the op is built once per venv.
export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-unit test-slow test-all bench clean

install: $(STAMP)

# Each step says what it does before it starts: pip runs quietly, and the set-up takes minutes.
$(STAMP): setup.py
	@echo "setting up $(VENV) (once; a few minutes): a Python virtual environment"
	python3 -m venv $(VENV)
	# torch first and pinned exactly, in the same command as deepspeed: an unpinned torch pulls a CUDA build.
	# setup.py asks for torch>=2.11 (the range gptpar supports), which keeps the torch installed here.
	@echo "$(VENV): installing torch 2.13.0 (the CPU build) and DeepSpeed 0.19.8 (most of the set-up time)"
	$(VENV)/bin/pip install -q torch==2.13.0 deepspeed==0.19.8
	@echo "$(VENV): installing gptpar (editable) with its test, evaluation and plotting extras (.[dev])"
	$(VENV)/bin/pip install -q -e ".[dev]"
	# DeepSpeed JIT-compiles its CPU shared-memory comm op at the first init_distributed (~40 s): build it
	# once now, into the venv's extensions folder, through gptpar's loader, which stamps it so that every later
	# start imports it as it is (gptpar/training/engine/comm_op.py), instead of inside the first test or the demo.
	@echo "$(VENV): building DeepSpeed's CPU shared-memory communication op (~40 s)"
	DS_ACCELERATOR=cpu $(PY) -c "from gptpar.training.engine.deepspeed_api import load_comm_op; load_comm_op()" \
		> /dev/null 2>&1 || echo "note: DeepSpeed's shm op did not prebuild; it will build on first use"
	touch $(STAMP)
	@echo "$(VENV) is ready"

demo: $(STAMP)
	$(PY) tools/demo.py

# Two pytest workers, each taking whole test files (--dist loadfile: a module's fixture trains once for all its
# tests). One worker alone leaves the cores idle much of the time: its tests wait on rank start-ups, rendezvous,
# launched subprocesses and timeouts. Two fill them (docs/benchmarks.md, "The test suite's own time").
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

# tests/unit: no process group, no subprocess (seconds); tests/integration: ranks, launchers, the trainer end to end.
test: $(STAMP)
	$(PYTEST) -m "not slow" tests/unit tests/integration

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-slow: $(STAMP)
	$(PYTEST) -m slow tests/integration

test-all: $(STAMP)
	$(PYTEST) tests/unit tests/integration

bench: $(STAMP)
	# docs/benchmarks.md's CPU figures (minutes on 2 cores); the GPU ones: bash bench/gpu.sh on a GPU machine.
	$(PY) bench/bench_single_rank.py
	$(PY) bench/bench_scaling.py
	$(PY) bench/bench_preprocess.py

clean:
	rm -rf $(VENV) build *.egg-info
