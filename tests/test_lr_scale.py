"""`train.vector_lr_scale`: the 1-D parameters' (norm weights, biases) learning rate over the matrices'."""

from __future__ import annotations

import torch

from lnfree.models.base import load_base
from lnfree.removal.config import with_overrides
from lnfree.removal.preparation import lr_scales, make_optimizer
from lnfree.removal.train import run

from conftest import small_gpt2


def test_the_vectors_group_takes_the_scale_and_the_matrices_keep_the_rate(run_config):
    model = small_gpt2(n_layer=2)
    for optimizer_name, expected in (("adamw", [1.0, 10.0]), ("muon", [1.0, 1.0, 10.0])):
        config = with_overrides(run_config(), {"train.vector_lr_scale": 10.0, "train.optimizer": optimizer_name})
        optimizer = make_optimizer(model, config)
        assert lr_scales(optimizer, config) == expected
        for group, scale in zip(optimizer.param_groups, expected):
            assert all((p.dim() < 2) == (scale == 10.0) for p in group["params"])


def test_a_run_moves_its_norm_weights_by_the_scale_more(run_config, tmp_path):
    start = dict(load_base(run_config().model)[0].named_parameters())

    def moved(scale: float) -> tuple[float, float]:
        config = with_overrides(run_config(max_steps=14), {"train.vector_lr_scale": scale, "train.eval_every": 0,
                                                           "output_dir": str(tmp_path / f"scale{scale:g}")})
        after = dict(run(config, progress=False).model.named_parameters())
        def change(dims):
            return sum(float((after[n] - start[n]).detach().abs().sum()) for n in start if (start[n].dim() < 2) == dims)
        return change(True), change(False)

    (vectors, matrices), (vectors_scaled, matrices_scaled) = moved(1.0), moved(20.0)
    assert vectors_scaled > 5 * vectors  # AdamW's step is about the learning rate: 20x, less where it turns
    assert 0.5 < matrices_scaled / matrices < 2.0
