"""Tests of adaptercl/system/."""
