"""Model names, parsed once.

Grammar (Ollama's, plus Hugging Face and file paths)::

    ref      := path | hf | short
    path     := anything that ends in ".gguf" and contains "/" or starts with "." or "~"
    hf       := ("hf.co" | "huggingface.co") "/" org "/" repo [":" quant]
    short    := [host "/"] [namespace "/"] name [":" tag]
    host     := part containing a "." or ":port"  (default "localllm": a name pulled from LOCALLLM_REGISTRY)
    namespace, name, org, repo := part            (namespace default "library")
    tag, quant := part                            (tag default "latest"; quant default chosen at pull time)
    part     := [A-Za-z0-9] [A-Za-z0-9_.-]{0,79}, never containing ".."
    digest   := "sha256" ("-" | ":") 64 lowercase hex digits

Names compare case-insensitively, so they are stored lower-cased (an HF quant keeps its case for display only).
A name that breaks the grammar raises InvalidName before any path is built from it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import InvalidName

DEFAULT_HOST = "localllm"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
HF_HOSTS = ("hf.co", "huggingface.co")
MAX_NAME_LENGTH = 256

_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,79}$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-]{0,252}(:\d{1,5})?$")
_DIGEST = re.compile(r"^sha256[-:]([0-9a-f]{64})$")

Kind = Literal["short", "hf", "file"]


@dataclass(frozen=True)
class ModelRef:
    kind: Kind
    host: str = DEFAULT_HOST
    namespace: str = DEFAULT_NAMESPACE
    name: str = ""
    tag: str = DEFAULT_TAG
    path: Path | None = None
    explicit_tag: bool = False

    @property
    def display(self) -> str:
        """The short form users type: `smollm2:135m`, `me/coder:latest`, `hf.co/org/repo:Q4_K_M`."""
        if self.kind == "file":
            return str(self.path)
        if self.kind == "hf":
            return f"hf.co/{self.namespace}/{self.name}" + (f":{self.tag}" if self.explicit_tag else "")
        prefix = ""
        if self.host != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        return f"{prefix}{self.name}:{self.tag}"

    @property
    def hostless(self) -> bool:
        """A short name typed without a host: a registry pull asks LOCALLLM_REGISTRY for it."""
        return self.kind == "short" and self.host == DEFAULT_HOST

    @property
    def repository(self) -> str:
        """`<namespace>/<name>`: the repository a registry serves this name's manifests and blobs under."""
        return f"{self.namespace}/{self.name}"

    @property
    def manifest_parts(self) -> tuple[str, ...]:
        """Path components of this name's manifest under models/manifests (validated parts only)."""
        if self.kind == "file":
            raise InvalidName(f"{self.path} is a file path, not a stored model name")
        if self.kind == "hf":
            # Short names are lower-cased when parsed; HF parts keep their case for display, so fold them here.
            return ("hf.co", self.namespace.lower(), self.name.lower(), self.tag.lower())
        return (self.host.replace(":", "_"), self.namespace, self.name, self.tag)

    def __str__(self) -> str:
        return self.display


def parse_ref(text: str) -> ModelRef:
    """Parse a model name; raise InvalidName saying what is wrong with it."""
    raw = (text or "").strip()
    if not raw:
        raise InvalidName("model name is empty", hint="for example smollm2:135m")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in raw):  # a NUL would reach the file system, and fail there
        raise InvalidName(
            f"model name {raw!r} is not valid: it holds a control character", hint="names and paths are plain text"
        )
    if _looks_like_path(raw):
        return ModelRef(kind="file", name=Path(raw).stem, path=Path(raw).expanduser())
    if len(raw) > MAX_NAME_LENGTH:
        raise InvalidName(f"model name is {len(raw)} characters; the limit is {MAX_NAME_LENGTH}")
    if raw.startswith("/") or "\\" in raw or "//" in raw:
        raise InvalidName(f"model name {raw!r} is not valid", hint="names look like smollm2:135m or me/coder:v1")
    body, tag, explicit = _split_tag(raw)
    parts = body.split("/")
    if parts[0].lower() in HF_HOSTS:
        return _parse_hf(raw, parts, tag, explicit)
    return _parse_short(raw, parts, tag, explicit)


def parse_digest(text: str) -> str:
    """Return the canonical `sha256-<hex>` form of a digest, or raise InvalidName."""
    match = _DIGEST.match((text or "").strip())
    if not match:
        raise InvalidName(f"digest {text!r} is not valid", hint="expected sha256-<64 lowercase hex digits>")
    return f"sha256-{match.group(1)}"


def _looks_like_path(raw: str) -> bool:
    return (
        raw.lower().endswith(".gguf")
        and (raw.startswith((".", "~", "/")) or "/" in raw)
        and not raw.lower().startswith(HF_HOSTS)
    )


def _split_tag(raw: str) -> tuple[str, str, bool]:
    last = raw.rsplit("/", 1)[-1]
    if ":" in last:
        body, tag = raw.rsplit(":", 1)
        _check_part(tag, "tag", raw)
        return body, tag, True
    return raw, DEFAULT_TAG, False


def _parse_hf(raw: str, parts: list[str], tag: str, explicit: bool) -> ModelRef:
    if len(parts) != 3:
        raise InvalidName(f"{raw!r} is not a Hugging Face name", hint="expected hf.co/<org>/<repo>[:<quant>]")
    for label, part in zip(("organisation", "repository"), parts[1:]):
        _check_part(part, label, raw)
    return ModelRef(kind="hf", host="hf.co", namespace=parts[1], name=parts[2], tag=tag, explicit_tag=explicit)


def _parse_short(raw: str, parts: list[str], tag: str, explicit: bool) -> ModelRef:
    if len(parts) > 3:
        raise InvalidName(f"model name {raw!r} has too many parts", hint="expected [host/][namespace/]name[:tag]")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, name = parts
        if not _HOST.match(host):
            raise InvalidName(f"host {host!r} in {raw!r} is not valid")
    elif len(parts) == 2:
        namespace, name = parts
    else:
        (name,) = parts
    _check_part(namespace, "namespace", raw)
    _check_part(name, "name", raw)
    return ModelRef(
        kind="short",
        host=host.lower(),
        namespace=namespace.lower(),
        name=name.lower(),
        tag=tag.lower(),
        explicit_tag=explicit,
    )


def _check_part(part: str, label: str, raw: str) -> None:
    if not _PART.match(part) or ".." in part:
        raise InvalidName(
            f"{label} {part!r} in model name {raw!r} is not valid",
            hint="use letters, digits, '.', '-' and '_' (at most 80), starting with a letter or digit",
        )
