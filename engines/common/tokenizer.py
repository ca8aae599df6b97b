"""The model folder's tokenizer (tokenizer.json, read with the `tokenizers` library), if it has one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.base import ModelLoadError


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """A `tokenizers.Tokenizer`, or None when the folder has no tokenizer.json."""
    path = Path(model_dir).expanduser() / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception on a malformed file)
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
