# Two commands: `make demo` and `make test`. Each sets up what it needs (venv, generated gRPC
# code, system packages) and skips what is already there.
PY      := .venv/bin/python
BIN     := .venv/bin
PROTOS  := $(shell find protos -name '*.proto')
SYSPKGS := espeak-ng flite chromium g++ ffmpeg prometheus

.PHONY: demo test check setup sysdeps protos clean

DEMO_TEXT ?= Hello, this is split-tts speaking. The weather today is cool and bright.

# The default voice end to end: text-service, vocoder-service and orchestrator start as local
# processes, the sentence streams through them into out/demo.wav, then they stop. The default
# voice's front end speaks through espeak-ng, so the demo installs the system packages too.
demo: setup sysdeps
	$(PY) -m orchestrator.cli synthesize "$(DEMO_TEXT)" -o out/demo.wav --seed 0

test: setup sysdeps check
	$(PY) -m pytest -q

# Lint, format, types and the import layering (pyproject.toml), before the slow tests.
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

setup: .venv/.installed splittts/.generated

# torch is pinned (FACTS.md): the pin takes the CPU wheel on this kind of machine.
.venv/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]" --config-settings editable_mode=compat
	@touch $@

splittts/.generated: $(PROTOS) protos/generate.py .venv/.installed
	rm -rf splittts
	$(PY) protos/generate.py .
	@touch $@

protos: splittts/.generated

# System packages the demo and the tests use, installed when missing: flite / espeak-ng (real speech, G2P),
# chromium (browser tests of the web demo), g++ (the CPU kernels in kernels/csrc, built on first
# use), ffmpeg (an independent decoder of every streamed audio format), prometheus (its promtool checks
# and unit-tests docker/monitoring's rules) and a CJK font for the web demo's screenshots.
sysdeps:
	@missing=""; for p in $(SYSPKGS); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	fc-list 2>/dev/null | grep -qi wqy || missing="$$missing fonts-wqy-zenhei"; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -qq $$missing >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; }; \
	fi

clean:
	rm -rf splittts out .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
