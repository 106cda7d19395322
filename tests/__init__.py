"""adaptercl's tests: one folder per folder of the package (tests/train/ tests adaptercl/train/); what
they share is in tests/support/ (on sys.path: pyproject.toml `pythonpath`)."""
