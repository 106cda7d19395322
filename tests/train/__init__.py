"""Tests of adaptercl/train/."""
