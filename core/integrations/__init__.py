"""Bridges to other libraries (imported on demand: each needs its library installed)."""
