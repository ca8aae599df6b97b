"""Result folders: written atomically, read back, and summaries recomputed from them.

    results/<run_id>/run.json           schema version, status, config, engine, workload,
                                        environment, summary
                     requests.parquet   one row per request: timestamps, lengths, outputs
                     steps.parquet      one row per engine step
                     telemetry.parquet  the sampler series
                     <name>.parquet     tables the engine adds (Engine.tables(), e.g. expert_bits)
A run streams into a hidden sibling, `.<name>.partial-<pid>/` (partial.json says
"incomplete"; requests.jsonl gets each request's row once it is final, steps.jsonl the steps):
a crash or SIGKILL leaves that folder with every finished request. At the end the parquet
files are built from the streams, run.json is written last and the folder renamed into place,
so a folder with run.json is complete and nothing else ever looks it. docs/results.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.errors import HarnessError

SCHEMA_VERSION = 1


def new_run_id(workload: str, engine: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", workload.split("/")[-1])[:40]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{engine}"


# Disk a run needs, for the free-space check before anything loads: the requests' stream
# and their parquet rows side by side at the end (rag_long on the dummy engine: ~9 KB of JSONL
# and ~1 KB of parquet a request with ~290 output tokens), plus steps and telemetry.
BYTES_PER_REQUEST = 24 * 1024
BYTES_PER_RUN = 8 * 2**20
ASSUMED_REQUESTS = 1000  # a run bounded only by --duration


def estimate_bytes(requests: int | None) -> int:
    return BYTES_PER_RUN + BYTES_PER_REQUEST * (requests or ASSUMED_REQUESTS)


def check_output(target: Path, need_bytes: int = 0, renamed: bool = True) -> None:
    """Fail in one line, before anything loads, when `target` cannot become a result folder:
    it exists and is not an empty folder, it lies under a file, its parent cannot be created or
    written (a temp file is created there to find out), it is a mount point (`renamed`: the
    finished folder is renamed onto it), or its disk has less than `need_bytes` free. Creates
    the parent folders."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HarnessError(f"output folder {target} already exists and is not empty; choose another --output")
    if renamed and target.is_dir() and os.path.ismount(target):
        raise HarnessError(f"output folder {target} is a mount point, and a run's folder is renamed into place at "
                           f"the end; give a folder inside it, e.g. --output {target / 'run1'}")
    existing = next(p for p in (target, *target.parents) if p.exists() or p == p.parent)
    if existing != target and not existing.is_dir():
        raise HarnessError(f"output folder {target} lies under {existing}, which is a file; choose another --output")
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent, prefix=".pwbench-write-test-"):
            pass
    except OSError as exc:
        raise HarnessError(f"output folder {target}: cannot write in {parent} ({exc.strerror or exc}); choose a "
                           f"writable --output") from None
    free = shutil.disk_usage(parent).free
    if free < need_bytes:
        raise HarnessError(f"output folder {target}: {parent} has {free / 2**20:,.0f} MiB free, this run needs about "
                           f"{need_bytes / 2**20:,.0f} MiB; free some space or choose another --output")


PARTIAL_MARKER = "partial.json"
REQUESTS_STREAM = "requests.jsonl"
STEPS_STREAM = "steps.jsonl"


def partial_folder(target: Path) -> Path:
    """The hidden sibling a run into `target` streams into: `.<name>.partial-<pid>`."""
    return target.parent / f".{target.name}.partial-{os.getpid()}"


class PartialRun:
    """A run's measured rows, appended to disk as the run goes (one JSON line each, flushed as
    each request's record becomes final), then turned into the result folder by `finish`.

    `open` checks the output (check_output) and creates the partial folder with partial.json
    (status incomplete); `add_request` / `add_steps` append; `requests_table` reads the stream
    back as an Arrow table; `finish` writes the folder; `abandon` (any exception before that)
    removes the partial folder when it holds no request, else keeps it and says where."""

    def __init__(self, target: Path, folder: Path) -> None:
        self.target, self.folder = target, folder
        self.requests = 0  # rows appended
        self.write_error: str | None = None  # why appending failed (a full disk): nothing more is written
        self._requests = open(folder / REQUESTS_STREAM, "a", encoding="utf-8")
        self._steps = open(folder / STEPS_STREAM, "a", encoding="utf-8")
        self._closed = False

    @classmethod
    def open(cls, target: Path, need_bytes: int = 0) -> PartialRun:
        target = Path(target)
        check_output(target, need_bytes)
        folder = partial_folder(target)
        shutil.rmtree(folder, ignore_errors=True)
        try:
            folder.mkdir()
            _write_marker(folder, target, None)
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise HarnessError(f"output folder {target}: cannot write {folder} ({exc.strerror or exc}); choose a "
                               f"writable --output") from None
        return cls(target, folder)

    def add_request(self, row: dict[str, Any]) -> bool:
        """One request's final row, on disk (flushed to the OS, so a SIGKILL keeps it) on return.
        False when it could not be written (`write_error` says why; the caller stops the run)."""
        if self.write_error is not None:
            return False
        try:
            self._steps.flush()  # the steps so far first: a row never outlives the steps it ran in
            self._requests.write(_LINE.encode(row) + "\n")
            self._requests.flush()
        except OSError as exc:
            self.write_error = f"{exc.strerror or exc}"
            return False
        self.requests += 1
        return True

    def add_steps(self, steps: list[dict[str, Any]]) -> bool:
        """Step rows, buffered (flushed with the next request row); False as add_request."""
        if self.write_error is not None:
            return False
        try:
            if steps:
                self._steps.write("".join(_LINE.encode(step) + "\n" for step in steps))
        except OSError as exc:
            self.write_error = f"{exc.strerror or exc}"
            return False
        return True

    def check_written(self) -> None:
        """Raise (one line, saying where the rows are) when appending failed during the run."""
        if self.write_error is not None:
            raise HarnessError(f"could not append to {self.folder / REQUESTS_STREAM} ({self.write_error}), so the "
                               f"run stopped; the {self.requests} requests measured before are kept there "
                               f"(partial.json: incomplete)")

    def _close_streams(self) -> None:
        for stream in (self._requests, self._steps):
            try:
                stream.close()
            except OSError:
                pass  # a full disk: what reached it is kept; a line cut short is skipped on reading

    def write_requests(self, columns: Callable[[list[dict]], dict[str, list]] | None = None) -> Path:
        """requests.parquet in the partial folder from the stream, in rows' final order, with
        `columns(rows)`'s columns added to each batch of rows; returns its path. Two passes
        over the stream (the columns' types, then the rows), so the whole table is never in
        memory. A failure raises a HarnessError saying where the rows are."""
        self._requests.flush()
        path = self.folder / "requests.parquet"
        try:
            write_stream_parquet(self.folder / REQUESTS_STREAM, path, columns)
        except OSError as exc:
            if path.is_file():
                path.unlink()  # half written
            raise self._not_written(exc) from None
        return path

    def replace_requests(self, rows: list[dict[str, Any]]) -> None:
        """requests.parquet rewritten from `rows` (after columns that need every row: fidelity)."""
        import pyarrow as pa  # noqa: PLC0415
        import pyarrow.parquet as pq  # noqa: PLC0415

        try:
            pq.write_table(pa.Table.from_pylist(rows), self.folder / "requests.parquet")
        except OSError as exc:
            raise self._not_written(exc) from None

    def _not_written(self, exc: OSError) -> HarnessError:
        return HarnessError(f"could not write the result files into {self.folder} ({exc.strerror or exc}); the "
                            f"{self.requests} measured requests are kept there in {REQUESTS_STREAM} "
                            f"(partial.json: incomplete)")

    def finish(self, run: dict[str, Any], steps: list[dict], telemetry: list[dict],
               tables: dict[str, list[dict]] | None = None) -> Path:
        """Write the other result files into the partial folder (requests.parquet is there:
        write_requests), run.json last, drop the streams and the marker, and rename the folder
        into place. A failure keeps the partial folder with its streams and raises a
        HarnessError saying where."""
        self._close_streams()
        self._closed = True
        try:
            _write_files(self.folder, run, None, steps, telemetry, tables or {})
        except OSError as exc:
            (self.folder / "run.json").unlink(missing_ok=True)
            raise self._not_written(exc) from None
        for name in (REQUESTS_STREAM, STEPS_STREAM, PARTIAL_MARKER):
            (self.folder / name).unlink(missing_ok=True)
        try:
            if self.target.exists():
                self.target.rmdir()  # empty (check_output made sure)
            self.folder.rename(self.target)
        except OSError as exc:
            raise HarnessError(f"could not move the result folder {self.folder} to {self.target} "
                               f"({exc.strerror or exc}); it is complete: move it yourself") from None
        return self.target

    def abandon(self, why: str) -> Path | None:
        """The run ended by an exception: keep the partial folder (marked incomplete, with `why`)
        when it holds a request and return it, else remove it."""
        if self._closed:
            return None  # finish() failed and has said where the rows are
        self._closed = True
        self._close_streams()
        if self.requests == 0:
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        try:
            _write_marker(self.folder, self.target, why)
        except OSError:
            pass  # the marker written at the start still says incomplete
        return self.folder


def _plain(value: Any) -> Any:
    """JSON for what json cannot write itself: numpy scalars as Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# One encoder for the streams' lines (json.dumps with options builds one per call: a simulated run
# writes thousands of step rows a second).
_LINE = json.JSONEncoder(separators=(",", ":"), default=_plain)


def _write_marker(folder: Path, target: Path, error: str | None) -> None:
    marker = {"status": "incomplete", "schema_version": SCHEMA_VERSION, "target": str(target), "pid": os.getpid(),
              "started_at_unix": time.time(), "requests": REQUESTS_STREAM, "steps": STEPS_STREAM, "error": error,
              "note": "a run that did not finish writing its result folder: every request row it measured is "
                      "in requests.jsonl (one JSON object a line); pwbench show/report/compare/gate read only "
                      "complete folders (run.json)"}
    (folder / PARTIAL_MARKER).write_text(json.dumps(marker, indent=1) + "\n")


# Rows turned into Python objects at a time (a rag_long row's token lists are ~20 KB of them),
# and rows per parquet row group (as Arrow, ~16 B a token).
STREAM_BATCH = 256
ROW_GROUP = 4096


def _stream_batches(path: Path, columns: Callable[[list[dict]], dict[str, list]] | None = None):
    """Pyarrow tables of STREAM_BATCH rows of a JSONL stream, `columns(rows)` added to each; a
    line cut short by a crash (the last) is left out."""
    import pyarrow as pa  # noqa: PLC0415

    def table(rows: list[dict]):
        for name, values in (columns(rows) if columns is not None else {}).items():
            for row, value in zip(rows, values):
                row[name] = value
        return pa.Table.from_pylist(rows)

    rows: list[dict] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                break  # cut short by a kill while it was written
            rows.append(json.loads(line))
            if len(rows) == STREAM_BATCH:
                yield table(rows)
                rows = []
    if rows:
        yield table(rows)


def _stream_schema(path: Path, columns: Callable[[list[dict]], dict[str, list]] | None = None):
    """The types every batch's columns fit (a column null so far takes a later batch's type,
    ints take floats); None for an empty stream."""
    import pyarrow as pa  # noqa: PLC0415

    schema = None
    for batch in _stream_batches(path, columns):
        schema = batch.schema if schema is None else pa.unify_schemas([schema, batch.schema],
                                                                      promote_options="permissive")
    return schema


def read_stream(path: Path):
    """A JSONL stream as one pyarrow Table (for small streams: tests, recovery)."""
    import pyarrow as pa  # noqa: PLC0415

    schema = _stream_schema(path)
    if schema is None:
        return pa.table({})
    return pa.Table.from_batches([b for t in _stream_batches(path) for b in t.cast(schema).to_batches()], schema)


def write_stream_parquet(stream: Path, path: Path, columns: Callable[[list[dict]], dict[str, list]] | None = None):
    """A JSONL stream as a parquet file, a batch at a time (`columns`: see _stream_batches)."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    schema = _stream_schema(stream, columns)
    if schema is None:  # no request: the empty file pandas writes, as ever
        import pandas as pd  # noqa: PLC0415

        pd.DataFrame([]).to_parquet(path, index=False)
        return
    import pyarrow as pa  # noqa: PLC0415

    with pq.ParquetWriter(path, schema) as writer:
        pending: list = []
        for batch in _stream_batches(stream, columns):
            pending.append(batch.cast(schema))
            if sum(t.num_rows for t in pending) >= ROW_GROUP:
                writer.write_table(pa.concat_tables(pending))
                pending = []
        if pending:
            writer.write_table(pa.concat_tables(pending))


def parquet_rows(path: Path, batch: int = STREAM_BATCH):
    """Rows of a parquet file as dicts, re-iterable, read a batch at a time (never all at once)."""
    return _ParquetRows(Path(path), batch)


class _ParquetRows:
    def __init__(self, path: Path, batch: int) -> None:
        self.path, self.batch = path, batch

    def __iter__(self):
        import pyarrow.parquet as pq  # noqa: PLC0415

        for part in pq.ParquetFile(self.path).iter_batches(batch_size=self.batch):
            yield from part.to_pylist()


def read_partial(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An incomplete run's partial.json and its request rows (recovery, tests)."""
    folder = Path(folder)
    marker = json.loads((folder / PARTIAL_MARKER).read_text())
    return marker, read_stream(folder / REQUESTS_STREAM).to_pylist()


_TABLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,40}")
_OWN_TABLES = ("requests", "steps", "telemetry", "run")


def write_run(target: Path, run: dict[str, Any], requests: list[dict], steps: list[dict], telemetry: list[dict],
              tables: dict[str, list[dict]] | None = None) -> Path:
    """`tables`: the engine's own result tables (Engine.tables()), one `<name>.parquet` each."""
    import pandas as pd  # noqa: PLC0415

    tables = tables or {}
    _check_tables(tables)
    check_output(target)
    tmp = partial_folder(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_files(tmp, run, pd.DataFrame(requests), steps, telemetry, tables)
        if target.exists():
            target.rmdir()  # empty (check_output made sure)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_tables(tables: dict[str, list[dict]]) -> None:
    bad = [n for n in tables if not _TABLE_NAME.fullmatch(n) or n in _OWN_TABLES]
    if bad:
        raise HarnessError(f"engine table names {bad} are not allowed (lowercase identifiers, not {_OWN_TABLES})")


def _write_files(folder: Path, run: dict[str, Any], requests, steps: list[dict], telemetry: list[dict],
                 tables: dict[str, list[dict]]) -> None:
    """requests (a DataFrame, or None when written already), steps, telemetry and the engine's
    tables as parquet, then run.json."""
    import pandas as pd  # noqa: PLC0415

    _check_tables(tables)
    if requests is not None:  # else already written (PartialRun.write_requests)
        requests.to_parquet(folder / "requests.parquet", index=False)
    for name, rows in (("steps", steps), ("telemetry", telemetry), *tables.items()):
        pd.DataFrame(rows).to_parquet(folder / f"{name}.parquet", index=False)
    (folder / "run.json").write_text(json.dumps(_clean(run), indent=1) + "\n")


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, tuples lists, numpy scalars Python numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def not_complete(folder: Path) -> HarnessError:
    """The error for a folder without run.json: a partial folder says what it is and where its rows are."""
    folder = Path(folder)
    if (folder / PARTIAL_MARKER).is_file():
        return HarnessError(f"{folder} is an incomplete run (killed or failed before its result folder was "
                            f"written): its measured requests are in {folder / REQUESTS_STREAM}; it has no "
                            f"summary, and pwbench tools read complete folders only (with run.json)")
    return HarnessError(f"{folder} is not a complete pwbench result folder (no run.json)")


def read_run(folder: Path) -> dict[str, Any]:
    """run.json of a complete result folder, its types checked (harness.result_checks)."""
    from harness.result_checks import read_run_json  # noqa: PLC0415  (it imports this module)

    return read_run_json(Path(folder))


def read_rows(folder: Path, name: str) -> list[dict[str, Any]]:
    """Rows of a parquet file as plain dicts: nulls as None, list columns as lists."""
    import pandas as pd  # noqa: PLC0415

    frame = pd.read_parquet(Path(folder) / f"{name}.parquet")
    rows = frame.to_dict("records")
    for row in rows:
        for key, value in row.items():
            if hasattr(value, "tolist"):
                row[key] = value.tolist()
            elif isinstance(value, float) and math.isnan(value):
                row[key] = None
            elif value is pd.NA:
                row[key] = None
    return rows
