"""Commands of the ``fastload`` CLI (typer + rich); each is a few lines over a library call."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.data import Dataset

import fastload
from fastload import __version__
from fastload.cache import Cache
from fastload.cache.formats import FORMATS
from fastload.cache.store import CacheFormat
from fastload.config import ChunkConfig
from fastload.dataset import CachedDataset, RemoteDataset, _listing_path
from fastload.errors import ConfigError, FastloadError
from fastload.manifest import Manifest, save_listing
from fastload.ranks import launcher_rank_world
from fastload.sources import DecodeSpec, Source
from fastload.sources.groups import group_decoder
from fastload.sources.labels import Labels
from fastload.sources.registry import source_of_options
from fastload.stores import parse_url
from fastload.stores._errors import redact, secret_values
from fastload.transforms import GROUP_DECODERS, decoder
from fastload.warm import WarmReport, cache_holds, warm_cache, warm_order

err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

app = typer.Typer(
    help="fastload: fast PyTorch data loading from object storage.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)
manifest_app = typer.Typer(help="Build or show a saved manifest.", no_args_is_help=True)
cache_app = typer.Typer(help="Inspect and maintain a cache directory.", no_args_is_help=True)
app.add_typer(manifest_app, name="manifest")
app.add_typer(cache_app, name="cache")

_state: dict[str, Any] = {"debug": False, "secrets": set()}
# credentials the environment may hold: never echoed in an error line
_SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "B2_APPLICATION_KEY",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
# warm-cache warms this many samples first, alone: when all fail alike, it fetches no more
STOP_AFTER = 8

StorageOptions = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option", "-o", help="KEY=VALUE for fsspec (repeatable; JSON values ok)."
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
KeyPattern = Annotated[
    str | None,
    typer.Option(help="Only the keys under SOURCE it matches (e.g. '*.tar', '{train,val}/*')."),
]
# how objects become samples, as RemoteDataset's arguments of these names (warm-cache, bench)
GroupBy = Annotated[
    str | None, typer.Option(help="Regex whose first group names a sample's group.")
]
Incomplete = Annotated[
    str,
    typer.Option(
        help="Groups (--group-by) or tar samples missing a member: raise, skip or accept."
    ),
]
Shards = Annotated[
    str | None,
    typer.Option(help="tar, parquet or zarr: many samples inside each object, read in place."),
]
RowKey = Annotated[
    str | None,
    typer.Option(
        help="With --shards parquet: the column whose runs of rows are one sample (as "
        "training gives it: the cached samples are named by it)."
    ),
]
Columns = Annotated[
    str | None,
    typer.Option(
        help="With --shards parquet: the columns to read, comma-separated (as training "
        "reads them: the cached samples are named by them)."
    ),
]
ZarrArray = Annotated[
    str | None,
    typer.Option(
        "--array",
        help="With --shards zarr: the array's path in the group SOURCE names (as Zarr's "
        "array=; the same samples and cache names as the array's own URL).",
    ),
]
Patch = Annotated[
    str | None,
    typer.Option(
        help="With --shards zarr: patch sizes along the array's first axes, comma-separated "
        "(as Zarr's patch=, e.g. 1,32,32; give them as training does).",
    ),
]
Decode = Annotated[
    str | None,
    typer.Option(
        help="As RemoteDataset's decode=: npy, npz, pt, raw, image, tiff, dicom, module:attr, "
        "or none (the sample as read); with --group-by or --shards tar also dicom-series (a "
        "whole group) or PATTERN=DECODER,... (each member by the first pattern it matches). "
        "Default: npy; with --shards, the sample as read."
    ),
]


def _secrets() -> set[str]:
    from_env = {os.environ.get(name, "") for name in _SECRET_VARIABLES} - {""}
    return set(_state["secrets"]) | from_env


def _redact_record(record: logging.LogRecord) -> bool:
    """Log lines (ours and the clients') pass through the same redaction as error lines."""
    text = record.getMessage()
    if record.exc_info:
        text += "\n" + logging.Formatter().formatException(record.exc_info)
        record.exc_info = None
    record.msg, record.args = redact(text, _secrets()), None
    return True


def _version(value: bool) -> None:
    if value:
        out.print(f"fastload {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    _state["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_redact_record)


# --- argument parsing ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``200GB``, ``500MiB``, ``1k`` or plain bytes (decimal units; ``iB`` ones are binary)."""
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"not a size: {text!r} (e.g. 200GB, 500MiB)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    prefix = unit[:1] if unit[:1] in ("k", "m", "g", "t") else ""
    base = 1024 if "i" in unit else 1000
    return int(number * base ** ("kmgt".index(prefix) + 1 if prefix else 0))


def parse_options(items: list[str] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option takes KEY=VALUE, got {key or item!r}")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    _state["secrets"] |= secret_values(options)
    return options


def parse_patch(text: str) -> tuple[int, ...]:
    """``--patch 1,32,32`` as Zarr's ``patch=`` (its sizes checked there)."""
    sizes = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in sizes):
        raise ConfigError(f"--patch takes sizes, comma-separated (e.g. 1,32,32), got {text!r}")
    return tuple(int(item) for item in sizes)


def parse_shard(text: str | None) -> tuple[int, int]:
    if text is None:
        return launcher_rank_world()
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ConfigError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


def load_object(spec: str, what: str) -> Any:
    """``module:attr`` imported, or a ConfigError naming what failed."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"--{what} must be module:attr, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: modules beside the user
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"--{what} {spec!r} does not import ({type(exc).__name__}: {exc})"
        ) from exc


def _decoder(spec: str | None, source: Source) -> DecodeSpec:
    """What ``--decode`` gives RemoteDataset's ``decode=`` (checked as it checks it), for
    ``source``'s samples, ``{member: bytes}`` (--group-by, --shards tar) or not: a name, a
    module:attr, none, or ``PATTERN=DECODER,...``; with none given, the source's default (npy;
    the sample as read with ``--shards``)."""
    members = source.by_member
    if spec is None:
        return source.default_decode
    if spec == "none":
        return None
    if "=" in spec:
        if not members:
            raise ConfigError(
                f"--decode {spec!r} decodes each member of a sample by pattern: it needs "
                "--group-by or --shards tar"
            )
        rules = {pattern: _one_decoder(name) for pattern, _, name in _pairs(spec)}
        group_decoder(rules)  # each decoder checked
        return rules
    one = _one_decoder(spec)
    if members:
        group_decoder(one)
    elif isinstance(one, str) and one in GROUP_DECODERS:
        raise ConfigError(
            f"--decode {one} decodes a whole group of objects: it needs --group-by (or "
            "--shards tar)"
        )
    else:
        decoder(one)
    return one


def _pairs(spec: str) -> list[tuple[str, str, str]]:
    """``PATTERN=DECODER,...`` split, each pair checked to have both sides."""
    pairs = [item.strip().partition("=") for item in spec.split(",")]
    for pattern, sep, name in pairs:
        if not (pattern and sep and name):
            raise ConfigError(f"--decode takes PATTERN=DECODER,..., got {spec!r}")
    return pairs


def _one_decoder(spec: str) -> str | Callable[[Any], Any]:
    """A decoder's name (checked by the caller) or a module:attr, imported."""
    if ":" in spec:
        loaded: Callable[[Any], Any] = load_object(spec, "decode")
        return loaded
    return spec


def _emit(result: dict[str, Any], as_json: bool, human: Callable[[], None]) -> None:
    if as_json:
        out.print_json(json.dumps(result, default=str))
    else:
        human()


# --- warm-cache ---------------------------------------------------------------------------------


@app.command("warm-cache")
def warm_cache_command(  # noqa: PLR0917 (typer maps each option to a parameter)
    source: Annotated[
        str | None,
        typer.Argument(help="URL of the objects (s3://, gs://, b2://, file://)."),
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", "-c", help="The cache directory.")
    ] = None,
    dataset_factory: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            help="module:attr making the dataset to warm (a CachedDataset or RemoteDataset "
            "with its own cache), instead of SOURCE and --cache-dir.",
        ),
    ] = None,
    group_by: GroupBy = None,
    incomplete: Incomplete = "raise",
    shards: Shards = None,
    row_key: RowKey = None,
    columns: Columns = None,
    array: ZarrArray = None,
    patch: Patch = None,
    on_error: Annotated[
        str,
        typer.Option(
            "--on-error",
            help="raise or skip, as training's on_error=. A shard that cannot be read as "
            "indexed (a truncated tar, a parquet file whose columns differ) stops the command, "
            "or is left out, named in a warning. A sample that fails is reported either way; "
            "under raise it makes the exit code 1, under skip it is named as skipped (exit 0).",
        ),
    ] = "raise",
    labels: Annotated[
        str | None,
        typer.Option(
            help="A CSV/JSON of labels by key (or group), or 'folders': checked before any "
            "fetch, so a join that leaves samples out fails first (labels are not cached)."
        ),
    ] = None,
    label_key: Annotated[str, typer.Option(help="The labels file's key column.")] = "key",
    label_field: Annotated[str, typer.Option(help="The labels file's label column.")] = "label",
    format: Annotated[str, typer.Option("--format", help="npy, pt or zarr.")] = "npy",
    decode: Decode = None,
    transform: Annotated[str | None, typer.Option(help="module:attr of the preprocessing.")] = None,
    in_flight: Annotated[
        int,
        typer.Option(
            "--in-flight",
            "--workers",  # its first name, kept working: not DataLoader workers
            help="Batches in flight at once.",
        ),
    ] = 4,
    batch_size: Annotated[int, typer.Option(help="Objects per concurrent batch.")] = 64,
    limit: Annotated[int | None, typer.Option(help="Only the first N objects.")] = None,
    shard: Annotated[
        str | None, typer.Option(help="I/N: this part of N (default RANK/WORLD_SIZE).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Warm in epoch-0 order of PermutationSampler(seed).")
    ] = None,
    max_bytes: Annotated[str | None, typer.Option(help="Cache budget, e.g. 200GB.")] = None,
    manifest: Annotated[
        Path | None, typer.Option(help="A saved manifest of SOURCE (skips listing).")
    ] = None,
    pattern: KeyPattern = None,
    cost_per_1k_requests: Annotated[
        float | None, typer.Option(help="Provider's GET price per 1,000.")
    ] = None,
    cost_per_gb: Annotated[
        float | None, typer.Option(help="Provider's egress price per GB.")
    ] = None,
    storage_option: StorageOptions = None,
    as_json: AsJson = False,
) -> None:
    """Fetch, decode, transform and cache every sample of SOURCE (resumable; Ctrl-C is safe)."""
    # everything that can be wrong with the arguments fails here, before any request
    part = parse_shard(shard)
    if dataset_factory is not None:
        beside = {
            "SOURCE": source,
            "--cache-dir": cache_dir,
            "--pattern": pattern,
            "--manifest": manifest,
            "--storage-option": storage_option,
            "--group-by": group_by,
            "--incomplete": None if incomplete == "raise" else incomplete,
            "--shards": shards,
            "--row-key": row_key,
            "--columns": columns,
            "--array": array,
            "--patch": patch,
            "--on-error": None if on_error == "raise" else on_error,
            "--labels": labels,
            "--label-key": None if label_key == "key" else label_key,
            "--label-field": None if label_field == "label" else label_field,
            "--format": None if format == "npy" else format,
            "--decode": decode,
            "--transform": transform,
            "--limit": limit,
            "--max-bytes": max_bytes,
        }
        ignored = [name for name, value in beside.items() if value is not None]
        if ignored:
            raise ConfigError(
                f"--dataset makes its own dataset, so {', '.join(ignored)} would be ignored: "
                "give them to the dataset it makes, or use SOURCE and --cache-dir instead"
            )
        made = _made_dataset(dataset_factory)
        skipping = made.on_error == "skip"
        datasets: Iterator[RemoteDataset | CachedDataset] = iter([made])
    else:
        if source is None or cache_dir is None:
            raise ConfigError("warm-cache needs SOURCE and --cache-dir (or --dataset)")
        cache_format = _as_format(format)
        parse_url(source)
        spec, decode_spec = _shape(
            source, pattern, group_by, incomplete, shards, (row_key, columns, array, patch), decode
        )
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"--on-error must be raise or skip, got {on_error!r}")
        skipping = on_error == "skip"
        options = parse_options(storage_option)
        transform_fn = load_object(transform, "transform") if transform else None
        budget = None if max_bytes is None else parse_size(max_bytes)
        # a folder it cannot use fails now
        cache = Cache(cache_dir, format=cache_format, max_bytes=budget)
        if manifest is None:
            listing = Manifest.build(source, pattern=pattern, storage_options=options)
            # where RemoteDataset(SOURCE, cache=...) looks for it: training starts without listing
            saved_at = _listing_path(source, pattern, None, cache, options)
            if saved_at is not None:  # (always, with a cache)
                save_listing(listing, saved_at)
        else:
            listing = Manifest.load(manifest, url=source)
            listing = listing if pattern is None else listing.filter(pattern=pattern)
        own = spec.warm_part(listing, part) if limit is None else None
        if own is not None:  # this machine's objects are all it reads and warms
            listing, part = own, (0, 1)
        make = partial(
            _remote,
            (cache_dir, cache_format, budget),
            spec,
            decode=decode_spec,
            transform=transform_fn,
            labels=None if labels is None else Labels(labels, key=label_key, field=label_field),
            limit=limit,
            on_error=on_error,
            storage_options=options,
        )
        in_rounds = part == (0, 1) and seed is None and limit is None
        rounds = (
            # half the memory each: the next round is opened (its shards indexed) while one warms
            spec.warm_rounds(listing, ChunkConfig.from_env().memory_bytes // 2)
            if in_rounds
            else [listing]
        )
        datasets = map(make, rounds)
    report = _warm_all(datasets, part, seed, batch_size, in_flight, quiet=as_json)
    result = report.as_dict()
    if cost_per_1k_requests is not None or cost_per_gb is not None:
        result["estimated_cost"] = round(
            report.requests / 1000 * (cost_per_1k_requests or 0)
            + report.bytes_fetched / 1e9 * (cost_per_gb or 0),
            6,
        )
    check = (
        f"what --dataset {dataset_factory} makes"
        if dataset_factory
        else f"--decode (here: {decode or spec.default_decode or 'the sample as read'}) and "
        "--transform against what training uses"
    )
    _emit(result, as_json, lambda: _print_warm(result, skipping=skipping, check=check))
    if as_json and report.evicted:  # stdout is the JSON: the warning goes beside it
        err.print(f"fastload: warning: {_evicted_warning(report.evicted)}", soft_wrap=True)
    if report.interrupted:
        raise typer.Exit(130)
    if report.stopped or report.unstored or (report.failures and not skipping):
        raise typer.Exit(1)


def _made_dataset(spec: str) -> RemoteDataset | CachedDataset:
    factory = load_object(spec, "dataset")
    try:
        made = factory() if callable(factory) and not isinstance(factory, Dataset) else factory
    except Exception as exc:
        raise ConfigError(f"--dataset {spec!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, (RemoteDataset, CachedDataset)) or made.cache is None:
        raise ConfigError(
            f"--dataset {spec!r} must give a CachedDataset or a RemoteDataset with a cache, "
            f"got {type(made).__name__}"
        )
    return made


def _as_format(name: str) -> CacheFormat:
    if name not in FORMATS:
        raise ConfigError(f"--format must be one of {sorted(FORMATS)}, got {name!r}")
    return name  # type: ignore[return-value]  # one of FORMATS


def _print_warm(result: dict[str, Any], *, skipping: bool, check: str) -> None:
    rate = result["samples"] / result["seconds"] if result["seconds"] else 0.0
    out.print(
        f"{result['samples']:,} samples ({result['hits']:,} already cached) "
        f"in {result['seconds']:.1f} s ({rate:,.0f}/s): {result['requests']:,} requests, "
        f"{result['bytes_fetched'] / 1e6:,.1f} MB fetched"
    )
    if "estimated_cost" in result:
        out.print(f"estimated cost: {result['estimated_cost']:.4f}")
    if result["stopped"]:
        out.print(f"stopped: {result['stopped']}; check {check}, then rerun", soft_wrap=True)
    else:  # one line each, unbroken (grep finds an object's)
        failed = "skipped (--on-error skip)" if skipping else "failed"
        for url, error in result["failures"].items():
            out.print(f"{failed}: {url}: {error}", soft_wrap=True)
    for reason in result["left_out"]:
        out.print(f"left out (--on-error skip): {reason}")
    if result["unstored"]:
        out.print(
            f"not cached: {result['unstored']:,} samples, the cache's disk is full (free space "
            "or pass --max-bytes, then rerun: cached samples are skipped)"
        )
    if result["evicted"]:
        out.print(f"warning: {_evicted_warning(result['evicted'])}", soft_wrap=True)
    if result["interrupted"]:
        out.print("interrupted: rerun the same command to finish (cached samples are skipped)")


def _evicted_warning(evicted: int) -> str:
    return (
        f"{evicted:,} of the samples warmed are not in the cache: its byte budget (--max-bytes, "
        "recorded in the cache folder) evicted them for later ones, or they are larger than "
        "the whole budget. Training will fetch and make them again: raise the budget to keep "
        "them all"
    )


def _shape(  # noqa: PLR0917 (the options of these names, in the commands' order)
    where: str,
    pattern: str | None,
    group_by: str | None,
    incomplete: str,
    shards: str | None,
    own: tuple[str | None, str | None, str | None, str | None],
    decode: str | None,
) -> tuple[Source, DecodeSpec]:
    """The source object of ``where`` that the options of those names make (through the
    registry, as RemoteDataset's), and its ``decode=``: a wrong one fails before any request.
    ``own``: the options of one source each, ``--row-key``, ``--columns`` (parquet),
    ``--array`` and ``--patch`` (zarr)."""
    if incomplete not in ("raise", "skip", "accept"):
        raise ConfigError(f"--incomplete must be raise, skip or accept, got {incomplete!r}")
    row_key, columns, array, patch = own
    source = source_of_options(
        where,
        shards=shards,
        group_by=group_by,
        pattern=pattern,
        incomplete=None if incomplete == "raise" else incomplete,
        row_key=row_key,
        columns=None if columns is None else columns.split(","),
        array=array,
        patch=None if patch is None else parse_patch(patch),
    )
    return source, _decoder(decode, source)


def _remote(
    cache: tuple[Path, CacheFormat, int | None], spec: Source, listing: Manifest, **kwargs: Any
) -> RemoteDataset:
    """A dataset of ``spec``'s samples in ``listing`` with a Cache of its own over the folder
    (its counters count its own warming alone: the next round's opening looks up the cache
    while one warms)."""
    folder, form, budget = cache
    source = replace(spec, where=listing, pattern=None)
    return RemoteDataset(source, cache=Cache(folder, format=form, max_bytes=budget), **kwargs)


def _warm_all(
    datasets: Iterator[RemoteDataset | CachedDataset],
    part: tuple[int, int],
    seed: int | None,
    batch_size: int,
    threads: int,
    *,
    quiet: bool,
) -> WarmReport:
    """Warm part ``part`` of each dataset in turn (one, or a tar dataset's groups of shards:
    the next is made, its shards indexed, while this one warms), under one progress bar; one
    report of all, what making the datasets read (the shards' indexing) and its time included.
    Its ``evicted`` counts, under a byte budget, an earlier group's samples that a later one's
    evicted too (each group's report counts its own at its end)."""
    total, started = WarmReport(), time.perf_counter()
    dataset: RemoteDataset | CachedDataset | None = next(datasets)  # before the bar: a wrong
    # argument fails before any read
    ahead = ThreadPoolExecutor(1, "fastload-next-group")
    kept: list[str] = []  # the cache names of the earlier groups' samples held at their end
    last = dataset
    with _progress(quiet) as progress:
        try:
            while dataset is not None:
                last = dataset
                upcoming = ahead.submit(next, datasets, None)
                blocks = dataset.blocks if isinstance(dataset, RemoteDataset) else None
                indices = warm_order(len(dataset), shard=part, seed=seed, blocks=blocks)
                progress.samples += len(indices)
                fetched = dataset.counters.fetch  # what making it read, the indexing
                before = total + WarmReport(requests=fetched.requests, bytes_fetched=fetched.bytes)

                def update(report: WarmReport, before: WarmReport = before) -> None:
                    progress.update(before + report)

                report = warm_cache(
                    dataset,
                    indices,
                    batch_size=batch_size,
                    threads=threads,
                    on_progress=update,
                    stop_after=STOP_AFTER if total.samples == 0 else None,  # its first samples
                )
                total = before + report
                stop = total.interrupted or total.stopped is not None
                following = None if stop else upcoming.result()
                if following is not None and _budgeted(dataset):
                    kept += cache_holds(dataset, indices)[1]
                dataset = following
        except KeyboardInterrupt:  # while the next group was indexed: what is cached stays
            total.interrupted = True
        finally:
            ahead.shutdown(wait=False, cancel_futures=True)
    if kept and last is not None and last.cache is not None:
        total.evicted += sum(not there for there in last.cache.contains_many(kept))
    total.seconds = time.perf_counter() - started
    return total


def _budgeted(dataset: RemoteDataset | CachedDataset) -> bool:
    return dataset.cache is not None and dataset.cache.max_bytes is not None


class _progress:
    """A rich progress bar on a terminal; plain log lines every 5 s otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.samples = 0  # the samples to warm: grows as a tar dataset's groups are indexed
        self.quiet = quiet
        self.bar: Progress | None = None
        self.last = 0.0

    def __enter__(self) -> _progress:
        if err.is_terminal and not self.quiet:
            self.bar = Progress(
                TextColumn("warming"),
                BarColumn(),
                TextColumn("{task.completed:,}/{task.total:,} samples {task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=err,
            )
            self.bar.start()
            self.task = self.bar.add_task("warm", total=None, info="")
        return self

    def update(self, report: WarmReport) -> None:
        rate = report.samples / report.seconds if report.seconds else 0.0
        info = f"{report.bytes_fetched / 1e6:,.0f} MB, {rate:,.0f}/s, {len(report.failures)} errors"
        if self.bar is not None:
            self.bar.update(self.task, total=self.samples, completed=report.samples, info=info)
        elif time.monotonic() - self.last >= 5 or report.samples == self.samples:
            self.last = time.monotonic()
            err.print(f"warming: {report.samples:,}/{self.samples:,} samples, {info}")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


# --- ls and manifest ----------------------------------------------------------------------------


@app.command("ls")
def ls_command(
    source: Annotated[str, typer.Argument(help="URL of the objects.")],
    storage_option: StorageOptions = None,
    pattern: KeyPattern = None,
    as_json: AsJson = False,
) -> None:
    """Count the objects under SOURCE, their total size, and show a few keys."""
    listing = Manifest.build(source, pattern=pattern, storage_options=parse_options(storage_option))
    result = {
        "url": listing.root,
        "pattern": listing.pattern,
        "objects": len(listing),
        "bytes": listing.total_bytes,
        "first_keys": listing.keys()[:5],
    }
    _emit(result, as_json, lambda: _print_listing(result))


def _print_listing(result: dict[str, Any]) -> None:
    matching = f" matching {result['pattern']}" if result["pattern"] else ""
    out.print(
        f"{result['url']}{matching}: {result['objects']:,} objects, {result['bytes'] / 1e6:,.1f} MB"
    )
    for key in result["first_keys"]:
        out.print(f"  {key}")


@manifest_app.command("build")
def manifest_build(
    source: Annotated[str, typer.Argument(help="URL of the objects.")],
    output: Annotated[Path, typer.Option("--output", "-O", help="Where to save the manifest.")],
    storage_option: StorageOptions = None,
    pattern: KeyPattern = None,
    as_json: AsJson = False,
) -> None:
    """List SOURCE once (in parallel) and save the manifest."""
    listing = Manifest.build(source, pattern=pattern, storage_options=parse_options(storage_option))
    listing.save(output)
    result = {
        "url": listing.root,
        "objects": len(listing),
        "bytes": listing.total_bytes,
        "saved": str(output),
    }
    _emit(result, as_json, lambda: out.print(f"{len(listing):,} objects saved to {output}"))


@manifest_app.command("show")
def manifest_show(
    path: Annotated[Path, typer.Argument(help="A saved manifest.")],
    as_json: AsJson = False,
) -> None:
    """Show a saved manifest's root, size, fingerprint and a few keys."""
    listing = Manifest.load(path)
    result = {
        "url": listing.root,
        "pattern": listing.pattern,
        "objects": len(listing),
        "bytes": listing.total_bytes,
        "fingerprint": listing.fingerprint,
        "labelled": listing.labels is not None,
        "first_keys": listing.keys()[:5],
    }
    _emit(result, as_json, lambda: _print_listing(result))


# --- cache maintenance --------------------------------------------------------------------------


def _caches(directory: Path) -> list[Cache]:
    try:
        (directory / "fastload-cache.json").stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{directory} is not a fastload cache") from None
    except PermissionError:
        pass  # Cache() names the folder and the permission this user lacks
    return [Cache(directory, format=_as_format(name)) for name in sorted(FORMATS)]


@cache_app.command("stats")
def cache_stats(directory: Annotated[Path, typer.Argument()], as_json: AsJson = False) -> None:
    """Entries and bytes per format."""
    result: dict[str, Any] = {
        c.format: {"entries": len(c), "bytes": c.stats()["used_bytes"] or 0}
        for c in _caches(directory)
    }

    def human() -> None:
        for name, row in result.items():
            out.print(f"{name}: {row['entries']:,} entries, {row['bytes'] / 1e6:,.1f} MB")

    _emit(result, as_json, human)


@cache_app.command("verify")
def cache_verify(directory: Annotated[Path, typer.Argument()], as_json: AsJson = False) -> None:
    """Read every entry; delete the corrupt ones (recomputed on next use). Exit 1 if any."""
    reports = {c.format: c.verify() for c in _caches(directory)}
    result: dict[str, Any] = {
        k: {"checked": r.checked, "corrupt": r.corrupt} for k, r in reports.items()
    }
    corrupt = sum(len(r.corrupt) for r in reports.values())
    _emit(
        result,
        as_json,
        lambda: out.print(
            f"checked {sum(r.checked for r in reports.values()):,} entries, "
            f"removed {corrupt} corrupt"
        ),
    )
    if corrupt:
        raise typer.Exit(1)


@cache_app.command("prune")
def cache_prune(
    directory: Annotated[Path, typer.Argument()],
    max_bytes: Annotated[str, typer.Option(help="Keep at most this much per format, e.g. 100GB.")],
) -> None:
    """Evict least recently used entries down to --max-bytes."""
    limit = parse_size(max_bytes)
    removed = sum(c.prune(max_bytes=limit) for c in _caches(directory))
    out.print(f"evicted {removed:,} entries")


@cache_app.command("clear")
def cache_clear(
    directory: Annotated[Path, typer.Argument()],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False,
) -> None:
    """Remove every entry (the directory stays a cache)."""
    caches = _caches(directory)
    if not yes and not sys.stdin.isatty():
        raise ConfigError(
            f"cache clear asks before it removes every entry in {directory}, and there is no "
            "terminal to answer on: pass --yes"
        )
    if not yes and not typer.confirm(f"remove every entry in {directory}?"):
        raise typer.Exit(1)
    caches[0].clear()
    out.print(f"cleared {directory}")


@app.command("bench")
def bench_command(  # noqa: PLR0917 (typer maps each option to a parameter)
    diagnose: Annotated[
        str,
        typer.Option(help="URL: time a loader over it alone and with a step; say which limits."),
    ],
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", "-c", help="--diagnose: cache directory.")
    ] = None,
    format: Annotated[str, typer.Option("--format", help="--diagnose: pt, npy or zarr.")] = "npy",
    group_by: GroupBy = None,
    incomplete: Incomplete = "raise",
    shards: Shards = None,
    row_key: RowKey = None,
    columns: Columns = None,
    array: ZarrArray = None,
    patch: Patch = None,
    decode: Decode = None,
    transform: Annotated[str | None, typer.Option(help="--diagnose: module:attr.")] = None,
    batch_size: Annotated[int, typer.Option(help="--diagnose: samples per batch.")] = 32,
    workers: Annotated[int | None, typer.Option(help="--diagnose: DataLoader workers.")] = None,
    steps: Annotated[int, typer.Option(help="--diagnose: batches timed per phase.")] = 30,
    step_ms: Annotated[
        float, typer.Option(help="--diagnose: a simulated training step of this many ms.")
    ] = 0.0,
    step: Annotated[
        str | None, typer.Option(help="--diagnose: module:attr, a step(batch) function.")
    ] = None,
    collate: Annotated[
        str | None,
        typer.Option(help="--diagnose: module:attr, the loader's collate_fn (ragged samples)."),
    ] = None,
    storage_option: StorageOptions = None,
    as_json: AsJson = False,
) -> None:
    """--diagnose one data source: is the loader or the step the bottleneck? (The benchmark
    suite against the peers is a tool of the repository: ``make bench``.)"""
    fn = load_object(step, "step") if step else (_sleep(step_ms / 1e3) if step_ms else None)
    own = (row_key, columns, array, patch)
    shape = _shape(diagnose, None, group_by, incomplete, shards, own, decode)
    loading = {
        "batch_size": batch_size,
        "num_workers": workers,
        "collate_fn": load_object(collate, "collate") if collate else None,
    }
    result = _diagnose(
        diagnose, cache_dir, format, shape, transform, loading, steps, fn,
        parse_options(storage_option),
    )  # fmt: skip
    _emit(result, as_json, lambda: out.print(result["verdict"]))


def _sleep(seconds: float) -> Callable[[Any], None]:
    return lambda _batch: time.sleep(seconds)


def _diagnose(  # noqa: PLR0917
    source: str,
    cache_dir: Path | None,
    format: str,
    shape: tuple[Source, DecodeSpec],
    transform: str | None,
    loading: dict[str, Any],
    steps: int,
    step: Callable[[Any], object] | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    cache_format = _as_format(format)
    parse_url(source)
    dataset = RemoteDataset(
        shape[0],
        decode=shape[1],
        transform=load_object(transform, "transform") if transform else None,
        cache=Cache(cache_dir, format=cache_format) if cache_dir else None,
        storage_options=options,
    )
    loader = fastload.DataLoader(dataset, shuffle=True, **loading)
    return fastload.diagnose(loader, step, steps=steps)


# --- entry --------------------------------------------------------------------------------------


def run(argv: list[str]) -> int:
    """Run the CLI; map errors to one line on stderr and an exit code."""
    try:
        code = app(args=argv, prog_name="fastload", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.TyperException as exc:  # usage errors of typer's own (vendored) click
        message = exc.format_message()
        err.print(f"fastload: usage error: {message}", markup=False)
        return int(getattr(exc, "exit_code", 2))
    except (typer.Abort, KeyboardInterrupt):
        err.print("fastload: interrupted")
        return 130
    except Exception as exc:
        if _state["debug"]:
            raise
        usage = isinstance(exc, ConfigError)
        kind = "usage error" if usage else "error"
        message = (
            str(exc)
            if isinstance(exc, (FastloadError, OSError))
            else f"{type(exc).__name__}: {exc}"
        )
        err.print(f"fastload: {kind}: {redact(message, _secrets())}", markup=False, soft_wrap=True)
        return 2 if usage else 1
    return code if isinstance(code, int) else 0  # a command's typer.Exit(code) lands here
