"""The forms of an LN-free model: export, loading, folding, verification, the TransformerLens bridge and the Hub."""
