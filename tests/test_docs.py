"""Every ```python block of README.md and docs/*.md runs, so an example that drifts from the code
fails here.

How a block runs: ``exec`` in a fresh namespace holding the names of tests/docs_names.py (the
reader's own code the examples leave out: ``preprocess``, ``train_step``, ``epochs``, a model)
that the block does not define itself, in a temporary folder that holds the local files the
example names (``labels.csv``). The URLs it names are real buckets on this session's loopback
servers, filled with the small data of tests/docs_data.py, and reached as a user's script
reaches them, through the clients' own configuration and not through the block's text:

- ``s3://``: SeaweedFS, through ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` and
  ``AWS_SECRET_ACCESS_KEY`` (botocore reads them for s3fs);
- ``b2://``: our B2 server, through ``B2_APPLICATION_KEY_ID`` and ``B2_APPLICATION_KEY``, and
  fsspec's configuration for the realm (``FSSPEC_B2_REALM`` in a user's environment);
- ``gs://``: fake-gcs-server, through fsspec's configuration (``FSSPEC_GS`` likewise).

Two rewrites of the block's text, both in its syntax tree, so line numbers stay the page's:
an absolute path (``"/nvme/cache"``) is moved under the temporary folder, and where the machine
lacks the accelerator a block names, ``"cuda"`` and ``"xla"`` run as ``"cpu"`` and ``"nccl"``
as ``"gloo"`` (the test id says so: ``[cuda-as-cpu]``). The DataLoader's default workers are
those of a 2-core machine (none: a loading thread), whatever this machine has.

A comment on the line before a block's fence steers it (``<!-- docs-test: ... -->``):

- ``skip="why"``: not run (a GPU count or a launcher this test cannot give, a record kept as
  it was);
- ``xfail="why"``: a library bug the block shows (strict: it must fail until fixed);
- ``name=NAME`` and ``after=NAME``: the block runs after the earlier block of its page
  named NAME, in its namespace (a collate function defined above, a loop it continues);
- ``setup=torchrun``: the environment torchrun gives one process (``RANK=0``,
  ``WORLD_SIZE=1``, ``MASTER_ADDR``...); ``setup=process_group`` also starts that group (gloo).
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import importlib.util
import inspect
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec.config
import pytest
import torch
import torch.distributed as dist

import fastload
import fastload.loader
from fastload.testing import B2Server, FakeGcsServer, SeaweedS3Server, free_port
from tests.conftest import write
from tests.docs_data import DATA, root_of
from tests.docs_names import names

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DIRECTIVE = re.compile(r"^<!-- docs-test: (.*) -->$")
DIRECTIVES = {"skip", "xfail", "name", "after", "setup"}
SETUPS = {"torchrun", "process_group"}
URL = re.compile(r"^(s3|gs|b2)://")
LOCAL_PATH = re.compile(r"^(/[\w.-]+)+/?$")  # "/nvme/cache", not "/" or a regex


@dataclass(frozen=True)
class Block:
    """One ```python block: its page (relative to the repository), the page line of its first
    line of code, its code, and the directives of the comment before its fence."""

    page: str
    line: int
    code: str
    directives: dict[str, str]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _directives(comment: str, where: str) -> dict[str, str]:
    match = DIRECTIVE.match(comment.strip())
    if match is None:
        return {}
    found = dict(token.split("=", 1) for token in shlex.split(match.group(1)))
    unknown = set(found) - DIRECTIVES
    if unknown or found.get("setup", "torchrun") not in SETUPS:
        raise ValueError(f"{where}: unknown docs-test directive in {comment.strip()!r}")
    return found


def blocks_of(page: Path) -> list[Block]:
    """The page's ```python blocks, in order."""
    lines = page.read_text().splitlines()
    relative = page.relative_to(ROOT).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            where = f"{relative}:{i + 2}"
            code = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(relative, i + 2, code, _directives(before, where)))
            i = end
        i += 1
    return blocks


def chain(block: Block, page: list[Block]) -> list[Block]:
    """The blocks to run for ``block``: those it comes ``after``, then itself."""
    after = block.directives.get("after")
    if after is None:
        return [block]
    named = [b for b in page if b.directives.get("name") == after and b.line < block.line]
    if not named:
        raise ValueError(f"{block.where}: after={after}: no earlier block of the page is named so")
    return [*chain(named[-1], page), block]


def _stand_ins() -> dict[str, str]:
    """Accelerator names this machine cannot serve, and what runs in their place."""
    cuda = torch.cuda.is_available()
    stand_ins = {}
    if not cuda:
        stand_ins["cuda"] = "cpu"
    if importlib.util.find_spec("torch_xla") is None:
        stand_ins["xla"] = "cpu"
    if not (cuda and dist.is_nccl_available()):
        stand_ins["nccl"] = "gloo"
    return stand_ins


STAND_INS = _stand_ins()


def _parsed(block: Block) -> ast.Module:
    """The block's syntax tree, its errors placed on the page's lines."""
    try:
        tree = ast.parse(block.code, str(ROOT / block.page))
    except SyntaxError as exc:
        exc.lineno = (exc.lineno or 1) + block.line - 1
        raise
    ast.increment_lineno(tree, block.line - 1)
    return tree


def _strings(block: Block) -> Iterator[str]:
    try:
        tree = _parsed(block)
    except SyntaxError:
        return  # the test reports it
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


class _Localised(ast.NodeTransformer):
    """Absolute paths moved under ``tmp``; accelerators the machine lacks replaced."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        value = node.value
        if not isinstance(value, str):
            return node
        if value in STAND_INS:
            value = STAND_INS[value]
        elif LOCAL_PATH.match(value):
            value = str(self.tmp / value.lstrip("/"))
        return ast.copy_location(ast.Constant(value), node)


def compiled(block: Block, tmp: Path) -> Any:
    tree = _Localised(tmp).visit(_parsed(block))
    return compile(ast.fix_missing_locations(tree), str(ROOT / block.page), "exec")


def _case(block: Block, page: list[Block]) -> Any:
    used = sorted({s for b in chain(block, page) for s in _strings(b) if s in STAND_INS})
    label = block.where + "".join(f"[{name}-as-{STAND_INS[name]}]" for name in used)
    marks = []
    if "skip" in block.directives:
        marks.append(pytest.mark.skip(reason=block.directives["skip"]))
    if "xfail" in block.directives:
        marks.append(pytest.mark.xfail(reason=block.directives["xfail"], strict=True))
    return pytest.param(chain(block, page), id=label, marks=marks)


PAGE_BLOCKS = {page: blocks_of(page) for page in PAGES}
CASES = [_case(block, blocks) for blocks in PAGE_BLOCKS.values() for block in blocks]


class Stores:
    """The buckets the examples name, each URL's objects written once a session."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self.buckets: set[tuple[str, str]] = set()
        self.written: set[str] = set()

    def server(self, scheme: str) -> SeaweedS3Server | B2Server | FakeGcsServer:
        fixture = {"s3": "seaweed", "b2": "b2", "gs": "gcs"}[scheme]
        server: SeaweedS3Server | B2Server | FakeGcsServer = self.request.getfixturevalue(fixture)
        return server

    def ensure(self, url: str) -> None:
        key = url.rstrip("/")
        if key not in DATA:
            raise AssertionError(f"no data for {url!r}: give it an entry in tests/docs_data.py")
        if key in self.written:
            return
        root = root_of(key)
        nested = [other for other in DATA if other != key and _nested(root_of(other), root)]
        assert not nested, f"{url}'s objects and those of {nested} lie under one another's root"
        scheme, path = key.split("://", 1)
        server = self.server(scheme)
        bucket = path.split("/", 1)[0]
        if (scheme, bucket) not in self.buckets:
            server.create_bucket(bucket)
            self.buckets.add((scheme, bucket))
        write(root, server.storage_options(), DATA[key].objects())
        self.written.add(key)


def _nested(a: str, b: str) -> bool:
    """Whether one of two roots lies under the other (an ImageFolder example listing one would
    find the other's objects), or they are one."""
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


@pytest.fixture(scope="module")
def stores(request: pytest.FixtureRequest) -> Stores:
    return Stores(request)


def _reach(scheme: str, stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point ``scheme``'s clients at its loopback server, as a user's environment would."""
    server = stores.server(scheme)
    if isinstance(server, SeaweedS3Server):
        for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    elif isinstance(server, B2Server):
        monkeypatch.setenv("B2_APPLICATION_KEY_ID", server.key_id)
        monkeypatch.setenv("B2_APPLICATION_KEY", server.key)
        monkeypatch.setitem(fsspec.config.conf, "b2", {"realm": server.endpoint})
    else:
        monkeypatch.setitem(fsspec.config.conf, "gs", server.storage_options())


def _setup(name: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun gives one process; ``process_group`` also starts its group."""
    if name is None:
        return
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    if name == "process_group":
        dist.init_process_group("gloo")


@pytest.mark.parametrize("blocks", CASES)
def test_docs_block_runs(
    blocks: list[Block],
    stores: Stores,
    seaweed: SeaweedS3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The block runs as written, against the loopback servers, without a warning."""
    urls = {s for b in blocks for s in _strings(b) if URL.match(s)}
    for url in sorted(urls):
        stores.ensure(url)
        for name, text in DATA[url.rstrip("/")].files.items():
            (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fastload.loader, "_cores", lambda: 2)
    fastload.shutdown()  # no client made under another configuration is reused
    for scheme in sorted({url.split("://")[0] for url in urls} | {"s3"}):
        _reach(scheme, stores, monkeypatch)
    namespace = {**names(tmp_path, seaweed), "__name__": "docs_example"}
    try:
        _setup(blocks[-1].directives.get("setup"), monkeypatch)
        for block in blocks:
            exec(compiled(block, tmp_path), namespace)
    finally:
        namespace.clear()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        fastload.shutdown()


# RemoteDataset's arguments before the source objects, each moved onto a source or fastload.Labels
MOVED = (
    "shards",
    "group_by",
    "members",
    "incomplete",
    "row_key",
    "columns",
    "chunks",
    "pattern",
    "manifest_path",
    "reuse_listing",
    "label_key",
    "label_field",
    "classes",
)


def _section(page: str, heading: str) -> str:
    """The text of ``page``'s section under ``heading``, up to the next heading of its level."""
    text = (ROOT / page).read_text()
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading) + 2)
    return text[start : None if end < 0 else end]


def test_the_upgrade_table_gives_every_moved_argument_its_new_spelling() -> None:
    """Each argument RemoteDataset no longer takes has a row in docs/migration.md's upgrade
    table, which says what to write instead."""
    taken = set(inspect.signature(fastload.RemoteDataset).parameters)
    assert not taken & set(MOVED), "these are RemoteDataset's again: the table misleads"
    rows = [
        line
        for line in _section("docs/migration.md", "## Upgrading to source objects").splitlines()
        if line.startswith("| `")
    ]
    for name in MOVED:
        assert any(f"{name}=" in row.split(" | ")[0] for row in rows), f"no row for {name}="


def test_the_shapes_page_names_every_source_and_its_options() -> None:
    """docs/shapes.md names every source of the registry, as users write it, and each of its
    options."""
    from fastload.sources.registry import SOURCES

    text = (ROOT / "docs" / "shapes.md").read_text()
    for name, kind in SOURCES.items():
        assert f"fastload.{kind.__name__}" in text, f"the {name} source is not in docs/shapes.md"
        assert getattr(fastload, kind.__name__) is kind, f"fastload.{kind.__name__} is not it"
        for field in dataclasses.fields(kind):
            assert f"`{field.name}" in text or f" {field.name}=" in text, (
                f"docs/shapes.md does not name {kind.__name__}'s option {field.name}"
            )
