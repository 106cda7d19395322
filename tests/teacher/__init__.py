"""Tests of adaptercl/teacher/."""
