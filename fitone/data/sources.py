"""Where a run's rows come from: a --data / --eval-data source opened as a memory-mapped Arrow table through the
`datasets` library, `sample` (the shipped numbers-to-words task), and the fields a run reads from it.

A source is a .jsonl/.json, .csv or .parquet file or glob, a directory written by `save_to_disk`, or a hub
dataset id (seq2seq: source/target fields; causal: text, prompt + text, or chat `messages`). Files are
converted once into Arrow files in datasets' cache and read from there by memory map, so a corpus larger
than RAM is never read into it. Every problem a user can fix is one DataError line.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitone.config import DataSettings
from fitone.data.chat import MESSAGES_FIELD, check_chat
from fitone.errors import ConfigError, DataError
from fitone.models import CAUSAL, SEQ2SEQ

SAMPLE_DIR = Path(__file__).parents[1] / "sample_data"
SAMPLE_TRAIN = SAMPLE_DIR / "numbers-train.jsonl"
SAMPLE_EVAL = SAMPLE_DIR / "numbers-eval.jsonl"
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
KINDS = ".jsonl/.json, .csv or .parquet"  # the files BUILDERS reads, as messages name them
EVAL_SPLITS = ("validation", "test")  # tried in this order when --eval-data is a hub id or a DatasetDict


def open_rows(spec: str, *, flag: str = "--data", split: str | None = "train", config_name: str | None = None,
              text_fields: Sequence[str] = (), use_cache: bool = True, verbose: bool = False):
    """The rows of `spec` as a `datasets.Dataset` (not read into memory). `split` None: the first of
    EVAL_SPLITS that exists. `text_fields` are read as text from a CSV (so '007' stays '007'). datasets' own
    progress bars ("Generating train split") and log lines show only when `verbose`."""
    with datasets_output(bars=verbose, logs=verbose):
        path = Path(spec).expanduser()
        if any(c in spec for c in "*?["):
            files = sorted(glob.glob(str(path), recursive=True))
            if not files:
                raise DataError(f"{flag} {spec} matches no files: check the pattern")
            rows = _load_files(files, spec, flag, text_fields, use_cache)
        elif path.is_dir():
            rows = _load_saved(path, flag, split)
        elif path.exists() or path.suffix.lower() in BUILDERS or spec.startswith((".", "/", "~")):
            rows = _load_files([str(path)], spec, flag, text_fields, use_cache)
        else:
            rows = _load_hub(spec, flag, split, config_name, use_cache)
    if len(rows) == 0:
        raise DataError(f"{flag} {_what(flag, spec)} holds no examples; add rows with the fields your options name")
    return rows


def _what(flag: str, spec: str) -> str:
    return f"file {spec}" if Path(spec).suffix.lower() in BUILDERS else spec


def _load_files(files: list[str], spec: str, flag: str, text_fields: Sequence[str], use_cache: bool):
    import datasets

    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = suffixes - BUILDERS.keys()
    if unknown or len({BUILDERS[s] for s in suffixes}) != 1:
        choices = ", 'sample' or 'synthetic'" if flag == "--data" else ""
        raise DataError(f"{flag} {spec}: give {KINDS} files of one kind{choices} "
                        f"(got {', '.join(sorted(suffixes)) or 'no extension'})")
    for f in files:
        p = Path(f)
        if not p.exists():
            choices = ", 'sample' or 'synthetic'" if flag == "--data" else ""
            raise DataError(f"{flag} file {f} does not exist: give the path of a {KINDS} file, a glob of them or a "
                            f"save_to_disk directory{choices}")
        if not os.access(p, os.R_OK):
            raise DataError(f"cannot read {flag} file {f}: permission denied; check its permissions")
    builder = BUILDERS[suffixes.pop()]
    extra: dict = {}
    if builder == "csv":
        extra["converters"] = {name: str for name in text_fields}
    if builder == "parquet":  # one row group at a time: pre-buffering reads far ahead of the conversion
        import pyarrow.dataset as pds

        extra["fragment_scan_options"] = pds.ParquetFragmentScanOptions(pre_buffer=False)
    try:
        rows = datasets.load_dataset(builder, data_files=files, split="train",
                                     download_mode=None if use_cache else "force_redownload", **extra)
        import pyarrow as pa

        pa.default_memory_pool().release_unused()  # the conversion's buffers: the rows are memory-mapped now
        return rows
    except ValueError as exc:
        if "corresponds to no data" in str(exc):  # every file was empty
            raise DataError(f"{flag} file {spec} holds no examples; add rows with the fields your options name") \
                from exc
        raise
    except Exception as exc:
        if builder == "json":
            for f in files:
                _explain_json(Path(f), text_fields, flag)
        cause = exc.__cause__ or exc
        raise DataError(f"{flag} {spec} cannot be read as {builder} ({type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}); fix the file or convert it") from exc


def _load_saved(path: Path, flag: str, split: str | None):
    import datasets

    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise DataError(f"{flag} path {path} is a directory: give a JSONL file (or .csv/.parquet, or a glob "
                        "like DIR/*.parquet), or a directory written by save_to_disk")
    loaded = datasets.load_from_disk(str(path))
    return _pick_split(loaded, str(path), flag, split)


def _load_hub(spec: str, flag: str, split: str | None, config_name: str | None, use_cache: bool):
    import datasets

    try:
        loaded = datasets.load_dataset(spec, config_name, split=split,
                                       download_mode=None if use_cache else "force_redownload")
    except Exception as exc:  # offline, unknown id, gated: all the same to the user
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        reason = "offline and not in the local cache" if offline or isinstance(exc, ConnectionError) \
            else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise DataError(f"{flag} {spec}: no such file, and the hub dataset cannot be loaded ({reason}): give a "
                        "local .jsonl/.csv/.parquet file or save_to_disk directory, or load the id once with "
                        "network (then --data-split/--data-config pick its part)") from exc
    return _pick_split(loaded, spec, flag, split)


def _pick_split(loaded, name: str, flag: str, split: str | None):
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    for want in ([split] if split else list(EVAL_SPLITS)):
        if want in loaded:
            return loaded[want]
    option = "--data-split" if flag == "--data" else "--eval-split"
    raise DataError(f"{flag} {name} has no split {split or ' or '.join(EVAL_SPLITS)!r}; its splits are "
                    f"{', '.join(loaded)}: pass {option} with one of them")


def check_fields(rows, fields: Sequence[str], *, flag: str, name: str, flag_of: dict[str, str]) -> None:
    """Every field is a text column without gaps; errors name the fields the data has."""
    import pyarrow.compute as pc

    have = rows.column_names
    for field in fields:
        if field not in have:
            raise DataError(f"{flag} {name} has no field {field!r} (its fields: {', '.join(have)}): rename the "
                            f"field or pass --{flag_of[field]} with the name your data uses")
        dtype = getattr(rows.features[field], "dtype", type(rows.features[field]).__name__)
        if dtype not in ("string", "large_string"):
            _first_not_text(rows, field, name)
        column = rows.data.column(field)
        if column.null_count:  # Arrow keeps the count in its metadata: no rows are read for this
            first = pc.index(pc.is_null(column), True).as_py() + 1
            raise DataError(f"{name}: example {first}: missing field {field!r}; rename the field or pass "
                            f"--{flag_of[field]} with the name your data uses")


def _first_not_text(rows, field: str, name: str) -> None:
    """Name the first example whose field is not text (read in batches: this is the error path only)."""
    done = 0
    for batch in rows.select_columns([field]).iter(batch_size=1000):
        for i, value in enumerate(batch[field]):
            if value is not None and not isinstance(value, str):
                raise DataError(f"{name}: example {done + i + 1}: field {field!r} must be text, "
                                f"got {type(value).__name__}")
        done += len(batch[field])


def _explain_json(path: Path, fields: Sequence[str], flag: str) -> None:
    """The first bad line of a JSON Lines file that datasets could not load, streamed (not read whole)."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read(1) == "[":
                return  # a JSON array, not JSON Lines: the builder's own message stands
            f.seek(0)
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    _check_line(path, lineno, line, fields)
    except UnicodeDecodeError as exc:
        raise DataError(f"{flag} file {path} is not UTF-8 text; convert it to UTF-8 JSONL") from exc
    except OSError as exc:  # os.access passes for root; the read itself can still be refused
        raise DataError(f"cannot read {flag} file {path}: {exc.strerror}; check its permissions") from exc


def _check_line(path: Path, lineno: int, line: str, fields: Sequence[str]) -> None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:  # exc.msg drops the position ("Invalid control character at"): say it
        reason = exc.msg.removesuffix(" at")
        raise DataError(f"{path}:{lineno}: not valid JSON at column {exc.colno} ({reason}); each line must be one "
                        "JSON object") from exc
    if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object with fields {', '.join(fields)}")
    for name in fields:
        if name in row and not isinstance(row[name], str):
            raise DataError(f"{path}:{lineno}: field {name!r} must be text, got {type(row[name]).__name__}")


@contextmanager
def datasets_output(*, bars: bool, logs: bool) -> Iterator[None]:
    """datasets' progress bars only where `bars`; its log lines (a failed load is logged at ERROR level before
    it raises, and fitone's one line says it instead) only where `logs`."""
    import datasets

    logger = logging.getLogger("datasets")
    level = logger.level
    if not logs:
        logger.setLevel(logging.CRITICAL)
    was_on = datasets.is_progress_bar_enabled()
    if not bars:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if was_on:
            datasets.enable_progress_bars()


class CausalFields(tuple):
    """(prompt field, text field) of a causal LM's rows: the loss is taken on the text only."""


class ChatFields(tuple):
    """(messages field,): rows are chat conversations; the loss is taken on the assistant turns only."""


def _field_flags(fields: Sequence[str]) -> dict[str, str]:
    """field -> the option that renames it, for error messages."""
    if isinstance(fields, ChatFields):
        return {fields[0]: "text-field"}
    if isinstance(fields, CausalFields):
        return {fields[0]: "prompt-field", fields[1]: "text-field"}
    if len(fields) == 1:
        return {fields[0]: "text-field"}
    return {fields[0]: "source-field", fields[1]: "target-field"}


def _user_fields(settings: DataSettings, task: str) -> tuple[str, ...]:
    if task == SEQ2SEQ:
        if settings.prompt_field:
            raise ConfigError(f"--prompt-field is for causal LMs; {settings.model} is seq2seq: its input is "
                              "--source-field and its output --target-field")
        if settings.pack:
            raise ConfigError(f"--pack is for causal LMs; {settings.model} is seq2seq: drop --pack (its batches are "
                              "padded to their longest example)")
        return (settings.source_field, settings.target_field)
    if settings.prompt_field:
        return CausalFields((settings.prompt_field, settings.text_field))
    return (settings.text_field,)


def data_file(settings: DataSettings, task: str, *, split: str = "train") -> tuple[str, tuple[str, ...]] | None:
    """The source (file, glob, save_to_disk dir or hub id) and text fields a run reads for `split`; None when
    there is none (synthetic data, or no --eval-data beside a user's data: fitone does not hold out silently)."""
    user_fields = _user_fields(settings, task)
    if split == "eval" and settings.eval_data:
        return settings.eval_data, user_fields
    if settings.data == "synthetic":
        return None
    if settings.data == "sample":
        if task != SEQ2SEQ:
            raise ConfigError("the sample task is seq2seq (numbers to words): use a T5 model, or --data FILE.jsonl "
                              "with a 'text' field for a causal LM")
        return str(SAMPLE_EVAL if split == "eval" else SAMPLE_TRAIN), ("source", "target")
    if split == "eval":
        return None
    return settings.data, user_fields


@dataclass
class Rows:
    """A source's rows, opened and checked (memory-mapped, not read), and the fields a run takes from them."""

    table: Any  # datasets.Dataset
    fields: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            part = self.table[i]
            return [dict(zip(part, values)) for values in zip(*part.values())]
        return self.table[int(i)]


def open_data(settings: DataSettings, task: str, *, split: str = "train") -> Rows | None:
    """Open the train (or eval) source and check its fields, before any weights load; None where data_file
    has none. Causal rows with a `messages` list and no text field are chat conversations."""
    found = data_file(settings, task, split=split)
    if found is None:
        return None
    spec, fields = found
    user_eval = split == "eval" and bool(settings.eval_data)
    flag = "--eval-data" if user_eval else "--data"
    table = open_rows(spec, flag=flag, split=(settings.eval_split if user_eval else settings.data_split),
                      config_name=settings.data_config, text_fields=fields, use_cache=settings.cache,
                      verbose=settings.verbose)
    if task == CAUSAL and not settings.prompt_field and settings.text_field not in table.column_names \
            and MESSAGES_FIELD in table.column_names:
        fields = ChatFields((MESSAGES_FIELD,))
        check_chat(table, spec)
    else:
        check_fields(table, fields, flag=flag, name=spec, flag_of=_field_flags(fields))
    return Rows(table, fields, spec)
