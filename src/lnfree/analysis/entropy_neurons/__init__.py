"""Entropy neurons: candidates, ablations, tables and figures (`run` ties them together)."""
