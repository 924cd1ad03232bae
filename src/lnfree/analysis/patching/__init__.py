"""Activation patching on IOI: the methods, their agreement and the output (`run` ties them together)."""
