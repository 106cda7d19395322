"""Tests of adaptercl/plan/."""
