"""Tests of adaptercl/recipe/."""
