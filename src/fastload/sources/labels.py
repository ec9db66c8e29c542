"""Labels joined to samples: a table or file by key (or group name), a callable, or folders.

:class:`Labels` is what ``RemoteDataset(labels=...)`` takes (a bare table, path, callable or
``"folders"`` is ``Labels(that)``); the sources whose samples take labels (objects, groups)
join them when opened.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from fastload.errors import ConfigError
from fastload.manifest import Manifest, check_classes, read_labels

__all__ = ["LabelSource", "Labels", "label_table", "labelled"]

log = logging.getLogger(__name__)

LabelSource = Mapping[str, int | str] | str | os.PathLike[str] | Callable[[str], int | str]


@dataclass(frozen=True, eq=False)
class Labels:
    """Each sample's label.

    table: a mapping of key (or group name) to label, a CSV or JSON file's path, a callable
        ``key -> label``, or ``"folders"``: the name of the folder holding each object (or
        group), as in torchvision's ImageFolder.
    key, field: the columns of a CSV/JSON file holding the key and the label.
    classes: the class names of string labels, in code order (by default these labels,
        sorted). Give another split's (``classes=train.classes``): a validation set that lacks
        a class would otherwise code every class after it one lower, without a word. A label
        not among them is an error.
    """

    table: LabelSource
    _: KW_ONLY
    key: str = "key"
    field: str = "label"
    classes: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.table, Mapping | str | os.PathLike) and not callable(self.table):
            raise ConfigError(
                "labels must be a mapping of key to label, a CSV or JSON file's path, 'folders' "
                f"or a callable key -> label, got {self.table!r}"
            )
        if self.classes is not None:
            check_classes(self.classes)

    @classmethod
    def of(cls, labels: Labels | LabelSource | None) -> Labels | None:
        """``labels`` as :class:`Labels` (a bare table, path, callable or "folders" alone)."""
        return labels if labels is None or isinstance(labels, Labels) else cls(labels)


def label_table(
    labels: Labels, names: Sequence[str], folder: Callable[[str], str]
) -> dict[str, int | str]:
    """The label of each of ``names`` that ``labels`` has (``folder``: a name's class folder,
    for ``"folders"``)."""
    table = labels.table
    if labels.table == "folders":
        return {name: folder(name) for name in names}
    if callable(table) and not isinstance(table, (str, os.PathLike, Mapping)):
        return {name: table(name) for name in names}
    if isinstance(table, Mapping):
        return dict(table)
    return read_labels(Path(table), labels.key, labels.field)


def labelled(manifest: Manifest, labels: Labels) -> Manifest:
    """``manifest`` with each object's label (a table, a file, a callable or ``"folders"``)."""
    keys = manifest.keys()
    if labels.table == "folders":
        return _class_folders(manifest, keys, labels.classes)
    table = labels.table
    if callable(table) and not isinstance(table, (str, os.PathLike, Mapping)):
        return manifest.with_labels({k: table(k) for k in keys}, classes=labels.classes)
    return manifest.with_labels(
        table, key_field=labels.key, label_field=labels.field, classes=labels.classes
    )


def _class_folders(manifest: Manifest, keys: list[str], classes: Sequence[str] | None) -> Manifest:
    """Labels as torchvision's ImageFolder gives them: each object's class is the folder right
    under the root that holds it, at any depth (``cat/indoor/1.jpg`` is a cat); objects in no
    folder are left out, and a warning names them (ImageFolder skips them too)."""
    table = {key: key.split("/", 1)[0] for key in keys if "/" in key}
    if not table:
        raise ConfigError(
            f"labels='folders': no object under {manifest.root} is in a folder (keys look like "
            f"{keys[:3]}); ImageFolder's layout is <root>/<class>/<file>"
        )
    loose = [key for key in keys if "/" not in key]
    if loose:
        log.warning(
            "labels='folders': leaving out %d objects under %s that are in no class folder: %s",
            len(loose),
            manifest.root,
            loose[:5],
        )
    return manifest.with_labels(table, missing="drop", classes=classes)
