"""`load_domain`: a `DomainConfig` -> a `Domain` (rows read, examples made, splits, hygiene). Deterministic per seed.

Where rows come from (`recipe.domain_block.source_kind` tells the kinds apart; its docstring has the rule):
- `builtin:NAME` -> `builtin.py` (generated, no files);
- a local file (.jsonl, .json list of objects, .parquet, .csv): training rows; evaluation rows from `eval_file`
  when given, else held out from the training rows;
- a local folder: `<train_split>.<ext>` and `<eval_split>.<ext>` inside it (e.g. gsm8k/train.jsonl, test.jsonl);
- an http(s) URL of a data file: as a local file, read by `datasets.load_dataset("json" | "parquet" | "csv",
  data_files=URL)` (cached by `datasets`; `eval_file` may be a URL too). Needs datasets' offline mode off:
  `HF_HUB_OFFLINE=1` blocks URLs as well, `HF_DATASETS_OFFLINE=0` lifts it for datasets only (`system/offline.py`).
  Quietly (`_datasets_quiet`): no progress bars (one data file, before the run's own progress starts) and none of
  `datasets`' log records, whose errors become the one line naming the field (a file that does not parse names
  the parser's complaint);
- a hub id: `load_dataset(id, subset, split=...)` (never called in tests).
A local path that does not exist is an error naming it, raised by `check_domain` before anything is read.

Splits and hygiene, in this order:
1. eval = the first `num_eval` usable rows of the evaluation rows, in file order; with no evaluation rows, the
   training rows are shuffled with the seed and the first `num_eval` are held out;
2. train = the remaining training rows, shuffled with the seed;
3. train rows whose prompt (all messages, whitespace-normalised) equals an eval prompt are dropped and counted in
   `Domain.overlap` (a warning is logged);
4. `num_train` caps what is left.
The domain's reward shows the SDPO teacher only the feedback `cfg.feedback` allows (`rewards.with_feedback`;
default: the format's reference behaviour, "format" for builtin sources). TRL-style rewards (`cfg.reward_funcs`, or a
`cfg.reward` with TRL's signature) become `Domain.batch_reward` (`trl_rewards.py`); every example keeps its row's
columns for them as they are, `fields` renaming none (`Example.columns`; a function reading a role `fields` maps
elsewhere is warned about once, `trl_rewards.fields_warning`), and whether the row gave its prompt as chat messages.
A malformed row raises `RecipeError` naming the file, row and field, and the rows the format expects (the columns
the row has beside them); with `skip_malformed` it is skipped and counted in `Domain.skipped`. A generic domain's
answer kind is read off the whole answer column when `answer_options` is given without `answer_kind`, and every gold
must take the form the reward compares with (`gold_answers.py`: a mismatch is one line, never a silent 0). The
same reading of a domain's first rows (`source_rows` with a limit, `rows_to_examples`) is `recipe validate`'s data
check (`data_check.py`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptercl.domains.builtin import BUILTINS, load_builtin
from adaptercl.domains.datasets_formats import FORMATS, MalformedRow, RowFormat, conversational_prompt, row_schema
from adaptercl.domains.domain import Domain, Example, RewardFn
from adaptercl.domains.gold_answers import check_golds, settle_answer_kind
from adaptercl.domains.rewards import resolve_reward, with_feedback
from adaptercl.domains.trl_rewards import TrlRewards, fields_warning, load_trl_rewards
from adaptercl.recipe import DATA_SUFFIXES, HUB_ID, DomainConfig, RecipeError, hub_id, is_url, source_kind, url_suffix
from adaptercl.system import dataset_message, first_line

log = logging.getLogger(__name__)

FILE_SUFFIXES = DATA_SUFFIXES
URL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # `datasets` loaders


def check_domain(cfg: DomainConfig) -> tuple[RewardFn | TrlRewards | None, tuple[Source, Source | None] | None]:
    """What can be checked before any row is read: the builtin name, the reward (a user `pkg.mod:fn` and every
    `reward_funcs` entry are imported, their signatures checked), local files and split files exist. Returns the
    reward (TRL-style rewards as one `TrlRewards`) and the sources (None for builtin)."""
    trl = load_trl_rewards(cfg)
    if cfg.source.startswith("builtin:"):
        task = cfg.source.removeprefix("builtin:")
        if task not in BUILTINS:
            raise RecipeError(f"domains.{cfg.name}.source: unknown builtin {task!r}; builtins: {', '.join(BUILTINS)}")
        return trl or (_domain_reward(cfg, cfg.reward) if cfg.reward else None), None
    if trl is not None:
        return trl, resolve_sources(cfg)
    fmt_name = cfg.format or "generic"
    reward_name = cfg.reward or FORMATS[fmt_name].reward
    if reward_name is None:
        raise RecipeError(
            f"domains.{cfg.name}.reward: the {fmt_name} format needs a reward (a REWARDS name or pkg.mod:fn)"
        )
    return _domain_reward(cfg, reward_name), resolve_sources(cfg)


def _domain_reward(cfg: DomainConfig, name: str) -> RewardFn:
    try:
        return resolve_reward(name, cfg.import_dirs)
    except RecipeError as err:  # "reward 'x': ..." -> "domains.NAME.reward 'x': ..."
        raise RecipeError(f"domains.{cfg.name}.{err}") from None


def load_domain(cfg: DomainConfig, seed: int, num_eval: int) -> Domain:
    """Build the domain of one recipe block: examples, eval set, reward, format patterns (see module docstring)."""
    reward, sources = check_domain(cfg)
    if isinstance(reward, TrlRewards) and (warning := fields_warning(cfg, reward)) is not None:
        log.warning("%s", warning)  # here, once per run: `check_domain` runs at validation and preflight too
    if isinstance(reward, TrlRewards) and not cfg.reward_funcs:  # a TRL-style `reward:` is a one-entry list
        cfg = cfg.model_copy(update={"reward": None, "reward_funcs": [cfg.reward]})
    if sources is None:
        domain = load_builtin(cfg, seed, num_eval)
        if isinstance(reward, TrlRewards):
            domain.reward, domain.batch_reward = reward.one, reward
        else:
            domain.reward = with_feedback(reward or domain.reward, cfg.feedback or "format")
        if cfg.format_patterns is not None:
            domain.format_patterns = list(cfg.format_patterns)
        return domain

    fmt_name = cfg.format or "generic"
    fmt = FORMATS[fmt_name]
    batch_reward = reward if isinstance(reward, TrlRewards) else None
    reward = reward.one if isinstance(reward, TrlRewards) else with_feedback(reward, cfg.feedback or fmt.feedback)
    if fmt_name == "generic" and not cfg.fields and cfg.format is None:
        log.info("domains.%s: no format given; reading fields prompt/answer/demonstration/system", cfg.name)

    train_source, eval_source = sources
    skipped = [0]
    eval_rows = source_rows(cfg, eval_source) if eval_source is not None else None  # first, as always
    train_rows = source_rows(cfg, train_source)
    cfg = settle_answer_kind(cfg, [row for _, row in train_rows[1] + (eval_rows[1] if eval_rows else [])])
    eval_examples = rows_to_examples(cfg, fmt, eval_rows, "eval", skipped, limit=num_eval) if eval_rows else []
    train_examples = rows_to_examples(cfg, fmt, train_rows, "train", skipped)
    check_golds(cfg, cfg.reward or fmt.reward, eval_examples + train_examples)  # every row: never a silent 0
    random.Random(seed).shuffle(train_examples)
    if eval_rows is None:  # held out from the shuffled training rows
        eval_examples, train_examples = train_examples[:num_eval], train_examples[num_eval:]

    eval_keys = {prompt_key(ex.messages) for ex in eval_examples}
    kept = [ex for ex in train_examples if prompt_key(ex.messages) not in eval_keys]
    overlap = len(train_examples) - len(kept)
    if overlap:
        log.warning(
            "domains.%s: %d training prompts also occur in the eval set; dropped from train", cfg.name, overlap
        )
    if skipped[0]:
        log.warning("domains.%s: skipped %d malformed rows", cfg.name, skipped[0])
    if cfg.num_train is not None:
        kept = kept[: cfg.num_train]
    if not kept:
        raise RecipeError(f"domains.{cfg.name}: no training examples left (source {cfg.source})")
    patterns = list(cfg.format_patterns) if cfg.format_patterns is not None else list(fmt.format_patterns)
    choice_letters = batch_reward is None and (cfg.reward or fmt.reward) == "choice_letter"
    return Domain(
        cfg.name,
        kept,
        eval_examples,
        reward,
        patterns,
        skipped=skipped[0],
        overlap=overlap,
        batch_reward=batch_reward,
        choice_letters=choice_letters,
    )


def prompt_key(messages: list[dict[str, str]]) -> tuple[tuple[str, str], ...]:
    """What makes two prompts identical: roles and whitespace-normalised contents of all turns."""
    return tuple((m["role"], " ".join(m["content"].split())) for m in messages)


# ---------------------------------------------------------------------------------------------------- sources

Source = tuple[str, Any]  # ("file", Path), ("url", str) or ("hub", split name)


def resolve_sources(cfg: DomainConfig) -> tuple[Source, Source | None]:
    """(training source, evaluation source or None = hold out); a missing local path is a RecipeError here."""
    eval_source = _eval_file(cfg)
    kind = source_kind(cfg.source)
    if kind == "url":
        return ("url", cfg.source), eval_source
    if kind == "hub":
        train = ("hub", cfg.train_split)
        if eval_source:
            return train, eval_source
        return train, ("hub", cfg.eval_split) if cfg.eval_split else None
    path = Path(cfg.source).expanduser()
    if path.is_file():
        return ("file", path), eval_source
    if path.is_dir():
        train = ("file", _split_file(cfg, path, cfg.train_split, "train_split"))
        if eval_source:
            return train, eval_source
        if cfg.eval_split is None:
            return train, None
        return train, ("file", _split_file(cfg, path, cfg.eval_split, "eval_split"))
    hint = f"; for the hub dataset of that name write hub:{cfg.source}" if HUB_ID.fullmatch(cfg.source) else ""
    raise RecipeError(f"domains.{cfg.name}.source: local path {cfg.source!r} does not exist{hint}")


def _eval_file(cfg: DomainConfig) -> Source | None:
    if not cfg.eval_file:
        return None
    if is_url(cfg.eval_file):
        return ("url", cfg.eval_file)
    path = Path(cfg.eval_file).expanduser()
    if not path.is_file():
        raise RecipeError(f"domains.{cfg.name}.eval_file: local file {cfg.eval_file!r} does not exist")
    return ("file", path)


def _split_file(cfg: DomainConfig, folder: Path, split: str, key: str) -> Path:
    for suffix in FILE_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    present = sorted(p.stem for p in folder.iterdir() if p.suffix in FILE_SUFFIXES)
    raise RecipeError(
        f"domains.{cfg.name}.{key}: no {split}.jsonl/.json/.parquet/.csv in {folder}; files there: {present}"
        + ("; set eval_split: null to hold out from train" if key == "eval_split" else "")
    )


def source_rows(cfg: DomainConfig, source: Source, limit: int | None = None) -> tuple[str, list[tuple[int, Any]]]:
    """(where, for error lines; the (row number, row) of one source), its first `limit` rows when given (a local
    file reads no further; hub and URL sources are read whole)."""
    kind, where = source
    if kind == "hub":
        return f"{hub_id(cfg.source)}[{where}]", _hub_rows(cfg, where)[:limit]
    if kind == "url":
        return where, _url_rows(cfg, where, "source" if where == cfg.source else "eval_file")[:limit]
    return str(where), read_rows(where, limit)


def rows_to_examples(
    cfg: DomainConfig,
    fmt: RowFormat,
    rows: tuple[str, list[tuple[int, Any]]],
    split: str,
    skipped: list[int],
    limit: int | None = None,
) -> list[Example]:
    """Examples of one source's `rows` (`source_rows`) in row order; stops after `limit` usable rows. A row the
    format cannot read is a RecipeError naming the file, the row, the field and the rows the format expects (or,
    with `skip_malformed`, counted in `skipped`)."""
    where_text, numbered = rows
    out = []
    for number, row in numbered:
        try:
            if isinstance(row, InvalidLine):
                raise MalformedRow(None, f"invalid JSON ({row.message})")
            if not isinstance(row, dict):
                raise MalformedRow(None, f"must be a JSON object, got {type(row).__name__}")
            messages, answer, demo = fmt.to_example(row, cfg)
        except MalformedRow as err:
            if not cfg.skip_malformed:
                raise RecipeError(
                    f"domains.{cfg.name}: {where_text}: row {number}: {err}; {row_help(cfg, row)}"
                ) from None
            skipped[0] += 1
            continue
        columns = dict(row)  # the row's columns, for TRL-style rewards
        out.append(
            Example(f"{cfg.name}/{split}/{number}", messages, answer, demo, columns, conversational_prompt(row, cfg))
        )
        if limit is not None and len(out) >= limit:
            break
    return out


def row_help(cfg: DomainConfig, row: Any) -> str:
    """What a row the format cannot read should have been, and the columns it has (a misspelt one shows there)."""
    if not isinstance(row, dict):
        return row_schema(cfg)
    columns = ", ".join(map(str, list(row)[:12])) + (", ..." if len(row) > 12 else "")
    return f"{row_schema(cfg)} (this row has {columns})"


@dataclass(frozen=True)
class InvalidLine:
    """A .jsonl line that is not JSON, kept as a row so it is reported (or skipped) with its line number."""

    message: str


def read_rows(path: Path, limit: int | None = None) -> list[tuple[int, Any]]:
    """(1-based row number, row) of a local file, its first `limit` rows when given; for .jsonl the number is the
    line number. A .csv or .parquet file is read as `datasets` reads it (pandas' CSV reader into Arrow), so a limited
    read gives the rows of a whole one, typed alike."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as err:
                    rows.append((number, InvalidLine(err.msg)))
        return rows
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise RecipeError(f"{path}: invalid JSON at line {err.lineno} ({err.msg})") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]}
        if not isinstance(data, list):
            raise RecipeError(f"{path}: a .json source must hold a list of rows")
        return list(enumerate(data[:limit], start=1))
    if suffix in (".parquet", ".csv") and limit is not None:
        return list(enumerate(_first_table_rows(path, limit), start=1))
    if suffix in (".parquet", ".csv"):
        import datasets

        reader = datasets.Dataset.from_parquet if suffix == ".parquet" else datasets.Dataset.from_csv
        with _datasets_quiet(progress_bars=False):  # one local file: no bar above the run's lines or an error's
            return list(enumerate(reader(str(path)), start=1))
    raise RecipeError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")


def _first_table_rows(path: Path, limit: int) -> list[dict]:
    """The first `limit` rows of a .csv (pandas' reader, as `datasets`' csv builder) or .parquet file, through Arrow
    as `datasets` gives them, without reading the rest or writing a cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
            return batch.to_pylist() if batch is not None else []
        import pandas as pd

        return pa.Table.from_pandas(pd.read_csv(path, nrows=limit), preserve_index=False).to_pylist()
    except Exception as err:  # a file that does not parse: one line, as a run's read of it
        raise RecipeError(f"{path}: not a readable {path.suffix} file ({first_line(err)})") from None


def _hub_rows(cfg: DomainConfig, split: str) -> list[tuple[int, Any]]:
    import datasets

    try:
        with _datasets_quiet(progress_bars=True):  # a hub dataset may be gigabytes: its download shows progress
            ds = datasets.load_dataset(hub_id(cfg.source), cfg.subset, split=split)
    except Exception as err:  # offline, unknown id, unknown split: one line, not a traceback
        what = f"hub dataset {hub_id(cfg.source)!r} split {split!r}"
        raise RecipeError(dataset_message(f"domains.{cfg.name}.source", what, err)) from None
    return list(enumerate(ds, start=1))


def _url_rows(cfg: DomainConfig, url: str, key: str) -> list[tuple[int, Any]]:
    """Rows of a data file at an http(s) URL, through `datasets` (which downloads and caches it)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    try:
        with _datasets_quiet(progress_bars=False):
            ds = datasets.load_dataset(URL_BUILDERS[url_suffix(url)], data_files=url, split="train")
    except DatasetGenerationError as err:  # fetched, but its parser refused it: say what the parser said
        cause = err.__cause__ or err
        raise RecipeError(
            f"domains.{cfg.name}.{key}: {url} is not a readable {url_suffix(url)} file ({first_line(cause)})"
        ) from None
    except Exception as err:  # offline, 404, unreachable: one line, not a traceback
        raise RecipeError(dataset_message(f"domains.{cfg.name}.{key}", url, err)) from None
    return list(enumerate(ds, start=1))


@contextmanager
def _datasets_quiet(progress_bars: bool) -> Iterator[None]:
    """`datasets` without its log records (a builder logs a file it cannot parse at ERROR, then raises; the caller
    reports it in one line) and, unless `progress_bars`, without its bars; both as they were afterwards.
    HF_DATASETS_DISABLE_PROGRESS_BARS, when set, decides the bars."""
    import datasets

    logger = logging.getLogger("datasets")
    level = logger.level
    hide_bars = not progress_bars and datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is None
    shown = hide_bars and not datasets.are_progress_bars_disabled()
    logger.setLevel(logging.CRITICAL + 1)
    if shown:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if shown:
            datasets.enable_progress_bars()
