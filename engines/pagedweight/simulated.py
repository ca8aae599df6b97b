"""PagedWeight under --simulate: what has no data in a simulated run, as stated models.

The arbiter, controller, backend moves and budget run as in a measured run. Two inputs are
computed from weights in a measured start and come from here instead:

- the experts' versions at each width (`meta_stores`): the same format code (formats.py
  `make_store`) runs on meta tensors, so every part's shape, dtype and bytes are the measured
  store's; it runs once per distinct expert shape and the other experts of that shape share
  its host-tier parts (meta tensors hold no data, so nothing is shared but shapes);
- each expert's sensitivity (`simulated_sensitivity`): its relative output error at each width
  from an error-vs-bits model: by default the bundled demo model's measured mean per width
  (below), or the `sim_sensitivity` option: a JSON file (the sensitivity table a measured
  run wrote under $PWBENCH_CACHE/sensitivity, or {"layer,expert": {"bits": error}}, or
  {"bits": error} for every expert) or an inline table "8:2e-5,4:0.008,3:0.03,2:0.11".
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from engines.base import EngineError

Key = tuple[int, int]
Table = dict[Key, dict[int, float]]

# The bundled demo model's mean per-expert relative output error (||f_b(x) - f(x)||^2 / ||f(x)||^2
# over its 8 experts, engines/pagedweight/sensitivity.py's measurement on the harness's demo
# calibration mix, group size 32, cpu float32), per representation and width. Produced by:
#   PWBENCH_CACHE=/tmp/pwsens python -c "
#   from harness.calibration import create_calibrated
#   for rep in ('bitplanes', 'requantize'):
#       e = create_calibrated('pagedweight', {'model': 'engines/demo_model', 'device': 'cpu', 'dtype': 'float32',
#                                             'budget_bytes': 3_000_000, 'representation': rep})
#       e.start(); s = e.paged.sensitivity
#       print(rep, {b: sum(v[b] for v in s.values()) / len(s) for b in (8, 4, 3, 2)}); e.stop()"
DEMO_SENSITIVITY: dict[str, dict[int, float]] = {
    "bitplanes": {8: 2.2384625481208786e-05, 4: 0.007915480120573193, 3: 0.03134273341856897,
                  2: 0.11265498492866755},
    "requantize": {8: 2.2384625481208786e-05, 4: 0.006465390993980691, 3: 0.033012937870807946,
                   2: 0.1850974401459098},
}
DEMO_SOURCE = "the bundled demo model's measured mean per-expert error (engines/pagedweight/simulated.py)"


def meta_stores(keys: Sequence[Key], build: Callable[[int, int], object],
                signature: Callable[[int, int], tuple]) -> dict[Key, object]:
    """Every expert's store, `build` run once per `signature` (the expert's tensor shapes, dtypes
    and options): the others are shallow copies of that store (same parts' shapes and bytes)."""
    made: dict[tuple, object] = {}
    out = {}
    for i, e in keys:
        sig = signature(i, e)
        if sig not in made:
            made[sig] = out[(i, e)] = build(i, e)
        else:
            out[(i, e)] = copy.copy(made[sig])
    return out


def _bits_table(doc: Mapping, where: str) -> dict[int, float]:
    try:
        table = {int(b): float(v) for b, v in doc.items()}
    except (TypeError, ValueError):
        raise EngineError(f"engine pagedweight: sim_sensitivity {where} must map bit widths to errors, e.g. "
                          '{"8": 2e-5, "4": 0.008, "3": 0.03, "2": 0.11}') from None
    return table


def _parse(spec: str) -> tuple[Table | None, dict[int, float] | None, str]:
    """(per-expert table or None, per-bits table or None, description) of a sim_sensitivity value."""
    path = Path(spec).expanduser()
    if not path.is_file():
        if ":" in spec and "/" not in spec and not spec.endswith(".json"):
            pairs = [w.split(":", 1) for w in spec.split(",") if w.strip()]
            return None, _bits_table(dict(pairs), repr(spec)), f"the table {spec}"
        raise EngineError(f"engine pagedweight: sim_sensitivity {spec}: no such file; give a JSON file or a table "
                          "like 8:2e-5,4:0.008,3:0.03,2:0.11")
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"engine pagedweight: cannot read sim_sensitivity {path}: {exc}") from None
    if isinstance(doc, dict) and isinstance(doc.get("sensitivity"), dict):
        doc = doc["sensitivity"]  # a table a measured run wrote (sensitivity.py's cache file)
    if not isinstance(doc, dict) or not doc:
        raise EngineError(f"engine pagedweight: sim_sensitivity {path} must hold a JSON object")
    if all("," in str(k) for k in doc):
        table: Table = {}
        for k, row in doc.items():
            try:
                layer, expert = (int(x) for x in str(k).split(","))
            except ValueError:
                raise EngineError(f"engine pagedweight: sim_sensitivity {path}: key {k!r} is not 'layer,expert'") \
                    from None
            if not isinstance(row, dict):
                raise EngineError(f"engine pagedweight: sim_sensitivity {path}: {k!r} must map bits to errors")
            table[(layer, expert)] = _bits_table(row, f"{path} [{k}]")
        return table, None, f"the per-expert table in {path}"
    return None, _bits_table(doc, str(path)), f"the per-width table in {path}"


def simulated_sensitivity(spec: str | None, keys: Sequence[Key], widths: Sequence[int], exact: Sequence[int],
                          representation: str) -> tuple[Table, str]:
    """{(layer, expert): {bits: error}} for every key and width (exact widths 0), and a note
    saying which model gave it."""
    quantized = [b for b in widths if b not in exact]
    if spec is None:
        per_bits: dict[int, float] | None = DEMO_SENSITIVITY[representation]
        per_expert, what = None, f"{DEMO_SOURCE}, {representation}"
    else:
        per_expert, per_bits, what = _parse(str(spec))
    table: Table = {}
    for key in keys:
        row = per_bits if per_expert is None else per_expert.get(key)
        if row is None:
            raise EngineError(f"engine pagedweight: sim_sensitivity {spec} has no row for expert {key[0]},{key[1]} "
                              "(layer,expert); give every expert, or a per-width table")
        lacking = [b for b in quantized if b not in row]
        if lacking:
            raise EngineError(f"engine pagedweight: sim_sensitivity {spec or 'default'} gives no error at "
                              f"{'/'.join(map(str, lacking))} bits; give every width in bits")
        table[key] = {b: 0.0 if b in exact else row[b] for b in widths}
    return table, (f"simulated: expert sensitivities (error at each width) from {what}, not measured; "
                   "override with --set sim_sensitivity=PATH|8:e8,4:e4,...")
