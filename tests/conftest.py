"""Shared fixtures: small random GPT-2 models and run configs (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it at import, as in pytest-xdist's workers

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

# pytest-xdist runs one worker per core (pyproject's addopts): the cores are shared out among the workers, and
# the processes a test starts inherit the share
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


def small_gpt2(n_layer: int = 2, n_embd: int = 32, n_positions: int = 32, vocab_size: int = 64, seed: int = 0):
    """A random GPT-2 without dropout, with LayerNorm affine parameters made non-trivial."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, n_positions=n_positions, vocab_size=vocab_size,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A local folder holding a random 2-layer GPT-2 and the tiny word-level tokenizer."""
    from lnfree.data.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    tokenizer = build_tokenizer(generate_documents(200, PRETRAIN_SEED))
    model = small_gpt2(n_layer=2, n_embd=48, n_positions=64, vocab_size=len(tokenizer))
    model.config.bos_token_id = model.config.eos_token_id = tokenizer.eos_token_id
    folder = tmp_path_factory.mktemp("models") / "random-gpt2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def quick_run_config(output_dir, model: str, cache_dir, **train):
    """A RunConfig that fine-tunes `model` on the tiny corpus for a few steps."""
    from lnfree.removal.config import RunConfig

    settings = {"max_steps": 16, "tokens_per_step": 8 * 64, "micro_batch_size": 4, "warmup_steps": 2,
                "log_every": 1, "learning_rate": 1e-3, "min_learning_rate": 1e-4, "sigma_init_batches": 2}
    settings.update(train)
    return RunConfig(
        model=str(model), output_dir=str(output_dir),
        data={"source": "tiny", "max_documents": 300, "val_fraction": 0.05, "context_length": 64,
              "eval_sequences": 4, "cache_dir": str(cache_dir)},
        train=settings,
        removal={"schedule": {"stages": [
            {"kind": "ln_2", "start": 2, "gap": 1}, {"kind": "ln_1qk", "gap": 1},
            {"kind": "ln_1v", "gap": 2}, {"kind": "ln_f", "gap": 0}]}},
    )


@pytest.fixture
def run_config(tmp_path, model_dir):
    return lambda **train: quick_run_config(tmp_path / "run", model_dir, tmp_path / "cache", **train)


@pytest.fixture(scope="session")
def tiny_ln_free_export(tmp_path_factory):
    """The bundled tiny model made LN-free without fine-tuning (σ measured, every norm fixed), exported.

    Its cross-entropy is worse than a fine-tuned removal's, but it is exactly LN-free: what the
    analyses' exactness tests need, in about a second.
    """
    from transformers import AutoTokenizer

    from lnfree.fixedscale import surgery
    from lnfree.forms.export import write_export
    from lnfree.data.tiny import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = surgery.install(GPT2LMHeadModel.from_pretrained(TINY_MODEL_DIR).eval())
    ids = torch.randint(0, len(tokenizer), (8, 64), generator=torch.Generator().manual_seed(0))
    surgery.initialise_sigmas(model, [ids])
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    folder = tmp_path_factory.mktemp("tiny") / "ln_free"
    write_export(model, tokenizer, folder, {"note": "test fixture: σ measured, no fine-tuning"})
    return folder


def byte_level_bpe(text: list[str], vocab_size: int = 3000):
    """A GPT-2-style byte-level BPE tokenizer (leading-space tokens, `<|endoftext|>`), trained in memory on `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def own_corpus(names, places, objects, n: int = 300, seed: int = 0) -> list[str]:
    """A user's own small corpus: two-name stories that use only the verbs "went" and "gave"."""
    import random

    rng = random.Random(seed)
    text = []
    for _ in range(n):
        a, b = rng.sample(list(names), 2)
        place, obj = rng.choice(list(places)), rng.choice(list(objects))
        article = "an" if obj[0] in "aeiou" else "a"
        text.append(f"Then, {a} and {b} went to the {place}. {a} gave {article} {obj} to {b}.")
    return text


def experiment_script(folder: str, name: str):
    """experiments/FOLDER/NAME.py as a module (its folder on the path while it loads: it may import its neighbours)."""
    where = Path(__file__).resolve().parents[1] / "experiments" / folder
    sys.path.insert(0, str(where))
    try:
        spec = importlib.util.spec_from_file_location(f"{folder}_{name}", where / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(where))
    return module
