"""Interpretability analyses of original, vanilla fine-tuned and LN-free models (every family of `lnfree.arch`).

Each analysis module exposes ``run(models, out_dir, ...) -> dict``: it takes a list of
:class:`lnfree.analysis.common.AnalysisModel` (typically original, vanilla, LN-free), writes tidy
tables (CSV), plotly figures (HTML, plus PNG when a static exporter is available) and a JSON
summary into ``out_dir``, and returns that summary.
"""
