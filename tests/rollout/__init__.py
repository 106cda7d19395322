"""Tests of adaptercl/rollout/."""
