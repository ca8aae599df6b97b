"""Where the bundled demo models live, and their names.

    demo        engines/demo_model/       Mixtral, 2 layers x 4 experts, top-2
    demo-fine   engines/demo_fine_model/  DeepSeek-V3: MLA, 1 shared + 16 routed experts, top-4, grouped routing

Each folder holds config.json, model.safetensors, the tokenizer and training.json
(docs/demo_model.md). `resolve_model` turns a name into its folder wherever a model folder
is expected, a config-only preset's name too (engines/common/presets.py: mixtral-8x7b,
deepseek-v3, ...; config.json only, for `--simulate`); a path that exists wins over a name.
"""

from __future__ import annotations

from pathlib import Path

from engines.base import ModelLoadError
from engines.common.presets import PRESETS

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"
DEMO_FINE_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_fine_model"
DEMO_MODELS = {"demo": DEMO_MODEL_DIR, "demo-fine": DEMO_FINE_MODEL_DIR}


def demo_model_path(name: str = "demo") -> Path:
    """The bundled model `name`'s folder (ModelLoadError when it is not installed)."""
    if name not in DEMO_MODELS:
        raise ModelLoadError(f"no bundled demo model is called {name!r}; use one of {', '.join(DEMO_MODELS)}")
    folder = DEMO_MODELS[name]
    if not (folder / "config.json").is_file():
        preset = "" if name == "demo" else f" --preset {name}"
        raise ModelLoadError(
            f"the bundled demo model {name!r} is missing from this installation ({folder}); "
            f"train one with `pwbench demo train{preset} --output DIR` and pass --model DIR"
        )
    return folder


def bundled_name(model: str | None) -> str | None:
    """Which bundled demo model `model` names (None: the default, `demo`), by name or folder;
    None for any other model."""
    if model is None:
        return "demo"
    path = Path(model).expanduser()
    if not path.exists():
        return model if model in DEMO_MODELS else None
    return next((name for name, folder in DEMO_MODELS.items() if folder.exists() and path.samefile(folder)), None)


def resolve_model(model: str | None) -> str | None:
    """A bundled model's name -> its folder (the demo models, and the config-only presets of
    engines/common/presets.py for `--simulate`); a path that exists, or anything else, unchanged."""
    if model is None or Path(model).expanduser().exists():
        return model
    if model in DEMO_MODELS:
        return str(demo_model_path(model))
    if model in PRESETS:
        return str(PRESETS[model])
    return model
