"""Offline lm-eval tasks for the demo model and the `pwbench eval` runner.

`write_demo_tasks(folder)` writes one JSONL file per demo task (the same held-out examples
`pwbench demo eval` uses) and a task YAML that reads it through the `json` dataset builder
with an absolute path (lm-eval resolves relative paths against the working directory).
`run_lm_eval` registers the pwbench model and runs lm-eval's own `simple_evaluate`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEMO_TASKS = {
    "demo_rag": "rag_recall",
    "demo_chat": "chat_recall",
    "demo_closed_book": "closed_book",
    "demo_copy": "copy",
}

_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["</s>"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_demo_tasks(folder: Path, samples: int = 200) -> Path:
    """Write the demo tasks' data and YAMLs into `folder`; returns it (an lm-eval include path)."""
    from harness.demo.eval import EvalSpec, demo_samples

    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    spec = EvalSpec(samples=samples)
    for name, task in DEMO_TASKS.items():
        rows = demo_samples(task, spec)
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"prompt": s.prompt, "answer": s.answer}) + "\n" for s in rows))
        max_gen = max(len(s.answer.split()) for s in rows) + 2
        (folder / f"{name}.yaml").write_text(_YAML.format(name=name, data=data, max_gen=max_gen))
    return folder


def require_lm_eval() -> None:
    import importlib.util

    from harness.errors import HarnessError

    if importlib.util.find_spec("lm_eval") is None:
        raise HarnessError("lm-eval is not installed; install it with: pip install -e '.[eval]' (or pip install "
                           "'lm_eval>=0.4.13,<0.5')")


def run_lm_eval(tasks: list[str], engine: str, model: str | None, include_path: Path, limit: int | None = None,
                options: dict[str, Any] | None = None) -> dict[str, Any]:
    """lm-eval's simple_evaluate over a pwbench engine; returns {task: {metric: value}} and raw results."""
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from harness.lmeval.model import PwbenchLM

    lm = PwbenchLM(engine=engine, model=model, **(options or {}))
    try:
        out = simple_evaluate(
            model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(include_path)),
            limit=limit, log_samples=False, bootstrap_iters=0,
        )
    finally:
        lm.engine.stop()
    metrics = {
        task: {k.split(",")[0]: v for k, v in values.items() if isinstance(v, (int, float)) and "stderr" not in k}
        for task, values in out["results"].items()
    }
    return {"metrics": metrics, "versions": out.get("versions", {}),
            "config": {"engine": engine, "model": model, "limit": limit}}


def lm_eval_cli(argv: list[str]) -> int:
    """lm-eval's own command line with the pwbench model registered (`pwbench lm-eval ...`)."""
    import sys

    require_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    import harness.lmeval.model  # noqa: F401  (registers "pwbench")

    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
    return 0
