"""What the harness does differently for a model that speaks the demo language: how to tell
(`uses_demo_language`), the workload defaults a run applies for it (DEMO_DEFAULTS), and the
demo-task synthesizer for its task workloads (`demo_synthesizer`). `pwbench run` and the
quantization calibration both use these, so neither imports the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.base import EngineInfo
    from workloads.demo.synth import DemoTaskSynthesizer

# Defaults for the demo model (trained up to ~1.4k tokens, 2k positions, on a CPU), applied
# only to options the user did not give: `scale` keeps each workload's shape at a size the
# demo serves; `time_scale` 0.1 compresses the traces' think times (RAGPulse's run to an
# hour) so the default run ends in minutes. Both are written into the run's notes.
DEMO_DEFAULTS: dict[str, dict[str, float]] = {
    "rag_long": {"scale": 0.25, "time_scale": 0.1},
    "long_chat": {"scale": 0.1, "time_scale": 0.1},
    "burst": {"scale": 0.25},
}
# Workloads whose prompts become scorable demo tasks on a demo-language model, and the task style.
DEMO_TASK_STYLES = {"rag_long": "rag", "long_chat": "chat"}


def uses_demo_language(model: str | None, info: EngineInfo) -> bool:
    """Whether `model`'s vocabulary is the demo language's (its tokenizer maps the same ids)."""
    from engines.common.tokenizer import load_tokenizer  # noqa: PLC0415
    from workloads.demo.language import demo_language  # noqa: PLC0415

    if model is None or info.vocab_size != len(demo_language().vocab):
        return False
    tok = load_tokenizer(model)
    return tok is not None and tok.get_vocab() == demo_language().token_to_id


def demo_synthesizer(workload: str, seed: int) -> DemoTaskSynthesizer | None:
    """The demo-task synthesizer for `workload` (a base name such as rag_long), or None when its
    prompts stay synthetic token ids."""
    if workload not in DEMO_TASK_STYLES:
        return None
    from workloads.demo.synth import DemoTaskSynthesizer  # noqa: PLC0415

    return DemoTaskSynthesizer(seed, DEMO_TASK_STYLES[workload])
