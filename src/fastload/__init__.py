"""fastload: drop-in PyTorch data loading for object storage."""

from __future__ import annotations

from fastload.cache import Cache
from fastload.config import ChunkConfig, FetchConfig
from fastload.dataset import CachedDataset, RemoteDataset
from fastload.device import DeviceLoader
from fastload.errors import (
    AccessDeniedError,
    CacheError,
    CacheFullError,
    ConfigError,
    CorruptEntryError,
    DecodeError,
    FastloadError,
    MissingExtraError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    RankExchangeError,
    ShardError,
    StoreError,
    TransientStoreError,
    UnsupportedSampleError,
)
from fastload.fetcher import Fetcher, Request, fetch
from fastload.loader import DataLoader
from fastload.manifest import Entry, Manifest, ManifestChanges
from fastload.ranks import this_rank_only
from fastload.resources import shutdown
from fastload.sampler import PermutationSampler, WeightedSampler
from fastload.sources import Source
from fastload.sources.labels import Labels
from fastload.sources.registry import Groups, Objects, Parquet, Tar, Zarr
from fastload.stall import diagnose
from fastload.transforms import QuantileNormalize, Resize, Transform, compose, versioned

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "Cache",
    "CacheError",
    "CacheFullError",
    "CachedDataset",
    "ChunkConfig",
    "ConfigError",
    "CorruptEntryError",
    "DataLoader",
    "DecodeError",
    "DeviceLoader",
    "Entry",
    "FastloadError",
    "FetchConfig",
    "Fetcher",
    "Groups",
    "Labels",
    "Manifest",
    "ManifestChanges",
    "MissingExtraError",
    "ObjectChangedError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "Objects",
    "Parquet",
    "PermutationSampler",
    "QuantileNormalize",
    "RankExchangeError",
    "RemoteDataset",
    "Request",
    "Resize",
    "ShardError",
    "Source",
    "StoreError",
    "Tar",
    "Transform",
    "TransientStoreError",
    "UnsupportedSampleError",
    "WeightedSampler",
    "Zarr",
    "__version__",
    "compose",
    "diagnose",
    "fetch",
    "shutdown",
    "this_rank_only",
    "versioned",
]
