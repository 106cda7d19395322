"""Tests of adaptercl/measure/."""
