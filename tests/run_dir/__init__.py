"""Tests of adaptercl/run_dir/."""
