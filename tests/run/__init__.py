"""Tests of adaptercl/run/."""
