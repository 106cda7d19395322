"""Tests of adaptercl/domains/."""
