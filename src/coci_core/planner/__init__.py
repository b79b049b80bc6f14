"""Convergence-aware checkpoint planner."""
