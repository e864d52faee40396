# Two commands on a fresh machine with only Python on it: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench bench-quick data translate compare verify clean

# The CPU build of torch 2.13.0 as a file on these machines' disk (pip's find-links). uv installs it from
# that file, with everything else, in one step (28 s for torch where pip took 49 s); uv does not look
# there by itself, so it is named by path. Elsewhere pip takes torch==2.13.0 first, from its own config.
TORCH_WHEEL := $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-*.whl))

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q uv $(if $(TORCH_WHEEL),,torch==2.13.0)
	# The rest with uv, 33 s where pip took 86 s. torch is named again (the file, or ==2.13.0) so that no
	# requirement can swap the CPU build for another one. Bytecode now, not at import: where
	# PYTHONDONTWRITEBYTECODE is set (it is on these machines) every import would compile again.
	$(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode $(or $(TORCH_WHEEL),torch==2.13.0) -e '.[dev]'
	# sktime only for the UCR .ts files its wheel ships (read from disk; a full install would downgrade pandas)
	$(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode --no-deps sktime==1.2.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m keyfold tour

# one pytest-xdist worker per core, each with its share of torch's threads (tests/conftest.py);
# worksteal: a worker that runs out takes tests from the other (the suite's durations are uneven)
XDIST := -n auto --dist worksteal

test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST)

# the edit-test loop: everything but the tests marked slow (CI runs them all)
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

bench-quick: $(STAMP)
	$(BIN)/python -m keyfold bench kernels --quick

bench: $(STAMP)
	$(BIN)/python -m keyfold bench kernels

# German-English data (installs Debian's dict-freedict-deu-eng with apt-get when missing) + tokenizer,
# once: stats.json is written last, so `make data` does nothing when done and a killed run resumes
DATA := data/deu-eng
data: $(DATA)/stats.json
$(DATA)/stats.json: | $(STAMP)
	$(BIN)/python -m keyfold train translate --prepare --data $(DATA)

# The Transformer's numbers: train the `cpu` recipe (resumes; runs/cpu), then beam 4 on the test split
# -> runs/cpu/test/ (hyp.txt, src.txt, ref.txt, scores.json, translate.md). The last checkpoint alone:
# averaging the last 5 (--average 5) scored lower on the validation split (docs/transformer.md)
translate: data
	$(BIN)/python -m keyfold train translate --config cpu --data $(DATA)
	$(BIN)/python -m keyfold translate --checkpoint runs/cpu --data $(DATA) --test --average 1

# The paper's Table 2 on our data: keyfold's Transformer, torch.nn.Transformer, GRU + attention,
# 10 training minutes each -> runs/compare/compare.{md,json,png}
compare: data
	$(BIN)/python -m keyfold train compare --data $(DATA) --minutes 10

verify: $(STAMP)
	$(BIN)/python -m keyfold verify

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
