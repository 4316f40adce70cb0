"""Experiments not wired into the engine, kept with their measurements (see each module's doc)."""
