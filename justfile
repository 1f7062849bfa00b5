# easycore tasks. `just demo` and `just test` set everything up from nothing (python3 + pip).
python := ".venv/bin/python"

# Create .venv and install easycore with its test extras (torch pinned by constraints.txt).
setup:
    test -x {{python}} || python3 -m venv .venv
    {{python}} -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"

# Run the headline demo.
demo: setup
    {{python}} examples/demo.py

# Run every test (unit, property, process, compat, examples, the docs' examples and site build).
test *args: setup
    {{python}} -m pytest {{args}}

# Lint and type-check.
lint: setup
    {{python}} -m ruff check pkg tests examples benchmarks
    {{python}} -m ruff format --check pkg tests examples benchmarks
    {{python}} -m pip install -q mypy && {{python}} -m mypy

# Build the documentation site into site/ (MkDocs; warnings are errors: a broken link or a
# name missing from the reference fails). NO_MKDOCS_2_WARNING silences Material's banner
# about MkDocs 2, which is not a warning of this build.
docs: setup
    {{python}} -m pip install -q -c constraints.txt -e ".[docs]"
    NO_MKDOCS_2_WARNING=1 {{python}} -m mkdocs build --strict

# Serve the documentation at http://127.0.0.1:8000, rebuilt as you edit.
docs-serve: setup
    {{python}} -m pip install -q -c constraints.txt -e ".[docs]"
    NO_MKDOCS_2_WARNING=1 {{python}} -m mkdocs serve

# Benchmarks against multiprocessing.Pool, concurrent.futures, joblib and mpire.
bench *args: setup
    {{python}} -m pip install -q -c constraints.txt -e ".[bench]"
    {{python}} benchmarks/run.py {{args}}

# The long soak test (random faults over many items).
soak: setup
    EASYCORE_SOAK=20000 {{python}} -m pytest tests/process/test_soak.py -v

# The conformance suite at length: 1,000 generated cases per local engine, 200 on Ray.
conformance: setup
    EASYCORE_CONFORMANCE=1000 EASYCORE_CONFORMANCE_RAY=200 {{python}} -m pytest tests/conformance -q
