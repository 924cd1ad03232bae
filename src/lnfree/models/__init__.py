"""Base models in: loading a pretrained model by name, path, Hub id or wheel."""
