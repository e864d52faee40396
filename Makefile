# Two commands on a fresh machine with only Python on it: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench bench-quick data translate verify clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU build of torch that lies on these machines, before anything that asks for torch.
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	# sktime only for the UCR .ts files its wheel ships (read from disk; a full install would downgrade pandas)
	$(BIN)/pip install --disable-pip-version-check -q --no-deps sktime==1.2.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m keyfold tour

test: $(STAMP)
	$(BIN)/python -m pytest

# the edit-test loop: everything but the tests marked slow (CI runs them all)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench-quick: $(STAMP)
	$(BIN)/python -m keyfold bench kernels --quick

bench: $(STAMP)
	$(BIN)/python -m keyfold bench kernels

# German-English data (installs Debian's dict-freedict-deu-eng with apt-get when missing) + tokenizer
data: $(STAMP)
	$(BIN)/python -m keyfold train translate --prepare

# The reported Transformer numbers: train the `cpu` config, then BLEU/chrF on the test split
translate: data
	$(BIN)/python -m keyfold train translate --config cpu
	$(BIN)/python -m keyfold translate --checkpoint runs/cpu --test

verify: $(STAMP)
	$(BIN)/python -m keyfold verify

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
