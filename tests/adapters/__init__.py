"""Tests of adaptercl/adapters/."""
