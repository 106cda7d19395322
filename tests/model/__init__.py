"""Tests of adaptercl/model/."""
