# `make test`: set up a local .venv (torch pinned, C++ extension built) and run the tests.
# `make demo`: the same setup, then a 2-rank training run on this machine.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Pinned: a bare `torch` would pull a multi-GB CUDA build. Override where another torch is
# preinstalled, e.g. `make test TORCH=` to keep it.
TORCH  ?= torch==2.13.0
# DeepSpeed itself, run beside zeroengine.deepspeed by the tests (tests/test_ds_scripts.py) on CPU
DEEPSPEED ?= deepspeed==0.19.8
STAMP  := $(VENV)/.installed-$(subst =,_,$(TORCH))
SOURCES := setup.py $(wildcard csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh csrc/*/*.h)

.PHONY: setup test test-fast demo nvme-demo bench compare docs clean

$(STAMP): $(SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) numpy pytest hypothesis ninja psutil
	# the optional integrations the tests cover: Ray Train, transformers (+ accelerate for its Trainer), Lightning, fastai, Keras 3, TensorBoard
	$(PY) -m pip install -q $(TORCH) "ray[train]" "transformers>=5,<6" accelerate "lightning>=2.2,<3" "fastai>=2.7,<3" "keras>=3,<4" tensorboard
	# the peer the DeepSpeed API is tested against (torch pinned in the same command), and what
	# the public DeepSpeed scripts in tests/ds_scripts/ import (HelloDeepSpeed's train_bert_ds.py)
	$(PY) -m pip install -q $(TORCH) $(DEEPSPEED) datasets fire loguru pytz sh
	# fastai depends on torchvision, and the only torchvision this machine's index holds for
	# torch 2.13 is the CUDA build, which does not load against the CPU torch (and Lightning
	# imports torchvision whenever it is installed). zeroengine's fastai integration does not use it.
	$(PY) -m pip uninstall -q -y torchvision
	$(PY) -m pip install -q -e . --no-build-isolation
	touch $(STAMP)

setup: $(STAMP)

test: setup
	# the slowest tests are listed at the end: the suite has to stay well inside CI's 90 minutes
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=40 tests

# the tests that stay in the pytest process (tests/conftest.py marks them): ~30 s
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m single_process tests

demo: setup
	$(PY) -m pip install -q tqdm matplotlib
	$(VENV)/bin/zeroengine train configs/demo_zero3.json --nproc 2

# NVMe offload under a memory cap: a 511M-parameter GPT at 2 ranks whose model states are 2.1x
# the memory each rank may use (docs/nvme.md); about 5 minutes here, swap files in .nvme_swap/
nvme-demo: setup
	OMP_NUM_THREADS=1 $(PY) benchmarks/nvme_demo.py --json bench_out/nvme_demo.json

bench: setup
	$(PY) benchmarks/step_bench.py

# Side by side with DeepSpeed (the `bench` extra, torch pinned in the same command), FSDP2,
# ZeroRedundancyOptimizer and DDP; ~30 minutes on 2 cores.
compare: setup
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(PY) benchmarks/compare.py --json bench_out/compare.json

docs: setup
	$(PY) -c "from zeroengine.config.reference import reference_markdown as r; print(r(), end=\"\")" > docs/config.md
	$(PY) -c "from zeroengine.tools.job_config import reference_markdown as r; print(r(), end=\"\")" > docs/job.md

clean:
	rm -rf $(VENV) build *.egg-info zeroengine/*.so
