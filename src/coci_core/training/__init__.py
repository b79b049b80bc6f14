"""The one door the framework adapters use: a planner and a manager together."""
