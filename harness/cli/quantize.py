"""`pwbench quantize`: a full-precision model folder in, a quantized Hugging Face folder out.

Calibration prompts come from a named workload (rag_long by default; demo-language prompts when
the folder is the demo model, as `pwbench run` makes them): harness/calibration.py. The work is
engines.quant.export.quantize_folder; this module parses options and prints progress. Heavy
imports stay inside the command (`pwbench --help` is light).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from engines.common.demo import resolve_model
from harness.cli.common import user_errors


def _layer_lines(r: Any) -> list[str]:
    topped = sum(a > 0 for a in r.added)
    alpha = "" if r.awq_alpha is None else f", AWQ alpha {r.awq_alpha:.2f}"
    return [
        f"layer {r.layer:>3}: rel. output error {r.rel_error:.5f} (RTN {r.rtn_rel_error:.5f}{alpha}); "
        f"tokens per expert {min(r.routed)}-{max(r.routed)} routed, {topped} experts topped up",
        "           routed " + " ".join(map(str, r.routed)),
        "           added  " + " ".join(map(str, r.added)),
    ]


@user_errors
def quantize(
    method: Annotated[str, typer.Option(help="gptq | awq | rtn")],
    output: Annotated[str, typer.Option(help="Folder to write (must not exist).")],
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Full-precision model folder, or bundled: demo (default), demo-fine.")] = None,
    bits: Annotated[int, typer.Option(help="2 | 3 | 4 | 8 (AWQ format: 4).")] = 4,
    group_size: Annotated[int | None, typer.Option(
        help="32 | 64 | 128 inputs per scale (default: the largest of these dividing the expert widths, "
             "else one group per row).")] = None,
    sym: Annotated[bool, typer.Option("--sym", help="Symmetric (no zero points).")] = False,
    act_order: Annotated[bool,
                         typer.Option("--act-order",
                                      help="GPTQ: columns by decreasing Hessian diagonal (g_idx).")] = False,
    damp: Annotated[float, typer.Option(help="GPTQ: Hessian damping, fraction of its mean diagonal.")] = 0.01,
    fmt: Annotated[str | None,
                   typer.Option("--format",
                                help="gptq | awq | compressed-tensors (default: gptq for "
                                     "gptq/rtn, awq for awq).")] = None,
    calib_workload: Annotated[str,
                              typer.Option(help="Workload the calibration prompts come from (see "
                                                "`pwbench ls workloads`).")] = "rag_long",
    calib_samples: Annotated[int, typer.Option(help="Calibration prompts.")] = 64,
    calib_len: Annotated[int, typer.Option(help="Tokens per calibration prompt, at most.")] = 2048,
    min_expert_tokens: Annotated[int,
                                 typer.Option(help="Top up experts routed fewer calibration tokens than this.")] = 128,
    seed: Annotated[int, typer.Option(help="Seed of the calibration prompts.")] = 0,
    dtype: Annotated[str | None,
                     typer.Option(help="Calibration dtype: float32 | bfloat16 | float16 (default: "
                                       "float32 on cpu, bf16 on cuda).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N (default: cuda if present).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or per-layer lines.")] = False,
    as_json: Annotated[bool,
                       typer.Option("--json",
                                    help="Print the report summary as one JSON object as the last line.")] = False,
) -> None:
    """Quantize a model's routed experts (RTN, GPTQ or AWQ, calibrated on a workload) into a Hugging Face folder."""
    model = resolve_model(model or "demo")  # a bundled model's name (demo, demo-fine) -> its folder
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from engines.common.folders import REPORT_FILE
    from engines.quant.calibrate import QuantizeOptions
    from engines.quant.export import preflight, quantize_folder
    from harness.calibration import calibration_prompts

    fit_note = None
    if group_size is None:  # not named: the largest standard size that fits the model
        from engines.runtime.checkpoint import open_checkpoint
        from engines.static_quant import fit_group_size

        cfg = open_checkpoint(model).config
        group_size, fit_note = fit_group_size(128, (cfg.hidden_size, cfg.moe_intermediate_size))
    options = QuantizeOptions(method, bits, group_size, sym, act_order, damp, min_expert_tokens)
    ckpt, scheme = preflight(model, output, options, fmt)  # fail before building prompts
    prompts = calibration_prompts(model, calib_workload, calib_samples, seed, calib_len)
    silent = quiet or as_json
    say = (lambda line: None) if silent else typer.echo
    if fit_note:
        typer.echo(f"note: {fit_note}", err=True)
    bar = Progress(TextColumn("[bold]quantize"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True, disable=silent)
    task = bar.add_task("layers", total=sum(ckpt.config.moe_layers))

    def on_layer(report: Any) -> None:
        if not silent:  # printed above the bar, which stays at the bottom
            for line in _layer_lines(report):
                bar.console.print(line, highlight=False, markup=False, soft_wrap=True)
        bar.advance(task)

    say(f"calibrating on {len(prompts)} {calib_workload} prompts ({sum(map(len, prompts))} tokens)")
    calibration = {"workload": calib_workload, "samples": calib_samples, "seed": seed, "max_len": calib_len}
    with bar:
        report = quantize_folder(model, output, options, prompts, fmt=scheme.fmt, device=device, dtype=dtype,
                                 calibration=calibration, progress=on_layer)
    summary = {k: report[k] for k in ("method", "format", "bits", "group_size", "mean_rel_error",
                                      "mean_rtn_rel_error", "quantize_s")}
    if as_json:
        typer.echo(json.dumps({"output": output, **summary}))
        return
    say(f"wrote {output} ({scheme.fmt}, {bits}-bit, group {group_size}) in {report['quantize_s']:.1f} s: mean rel. "
        f"output error {report['mean_rel_error']:.5f} vs RTN {report['mean_rtn_rel_error']:.5f}; per-expert "
        f"calibration tokens in {output}/{REPORT_FILE}")
