"""Tests of adaptercl/ship/."""
