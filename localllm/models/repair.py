"""`localllm verify --repair`: download again the blobs that are missing or that `verify` found corrupt, wherever the
bytes have a source pinned by digest (a catalog entry, a Hugging Face repo, a registry's manifest). The good bytes
replace the corrupt file in place, so every model naming that blob is whole again, copies included."""

from __future__ import annotations

from collections.abc import Iterator

from .. import api
from .catalog import CATALOG
from .names import parse_ref
from .pull import CatalogSource, HFSource, download_url
from .registry import RegistrySource
from .store import Store

Progress = Iterator[api.PullProgress]


def repair_blobs(store: Store, name: str | None = None) -> Progress:
    """Fetch each damaged blob of `name` (or of every model) again; a blob with no known source is named in a
    progress line and left for the caller's verify to report."""
    with store.blobs.writing():
        for digest, names in store.damaged(name).items():
            yield from _repair_one(store, digest, names)


def _hf_source(store: Store, names: list[str]) -> HFSource | None:
    """The Hugging Face repo one of `names` was pulled from: as recorded in its manifest, else as its name says."""
    for name in names:
        record = store.source_of(name) or {}
        if "hf" in record:
            return HFSource.from_record(record)
    hf_name = next((n for n in names if parse_ref(n).kind == "hf"), None)
    return HFSource(parse_ref(hf_name)) if hf_name else None


def _repair_one(store: Store, digest: str, names: list[str]) -> Progress:
    entry = next((e for e in CATALOG if e.digest == digest), None)
    if entry is not None:
        yield api.PullProgress(status=f"repairing {digest} from the catalog ({entry.name})", digest=digest)
        with store.blobs.pin(digest):
            yield from CatalogSource(entry).fetch_blob(store)
        return
    pulled = next((n for n in names if "registry" in (store.source_of(n) or {})), None)
    if pulled is not None:  # the tag is fetched again: its layers are named by digest
        yield api.PullProgress(status=f"repairing {digest} from the registry ({pulled})", digest=digest)
        insecure = str((store.source_of(pulled) or {}).get("registry", "")).startswith("http://")  # as pulled
        yield from RegistrySource(parse_ref(pulled), download_url, insecure=insecure).pull(store)
        return
    hf = _hf_source(store, names)
    if hf is not None:
        yield api.PullProgress(status=f"repairing {digest} from hf.co/{hf.repo}", digest=digest)
        yield from hf.pull(store)
        return
    yield api.PullProgress(
        status=f"cannot repair {digest} of {', '.join(names)}: it has no catalog, Hugging Face or "
        "registry source; pull, create or import it again",
        digest=digest,
    )
