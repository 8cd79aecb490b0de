PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/aurakernel autotune --config trainer/configs/tiny.yaml --out plan.json
	$(BIN)/aurakernel train --config trainer/configs/tiny.yaml --kernels plan.json --steps 20 --compare

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15 tests

bench: install
	$(BIN)/aurakernel bench --out docs/bench --readme README.md --baseline benchmarks/baselines
	$(BIN)/python -m benchmarks.rms_norm
	$(BIN)/python -m benchmarks.ascend

clean:
	rm -rf $(VENV) build *.egg-info plan.json

plan.json: $(STAMP)
	$(BIN)/aurakernel autotune --config trainer/configs/tiny.yaml --out plan.json
