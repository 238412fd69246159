"""Pull by Ollama library name: the registry protocol `ollama pull` speaks, and Ollama's layers mapped onto ours.

A short name that is not a catalog entry, `[host/][namespace/]name[:tag]`, names a manifest in a registry: the
name's host, or LOCALLLM_REGISTRY for a name without one (namespace `library`, tag `latest` by default)::

    GET <registry>/v2/<namespace>/<name>/manifests/<tag>    Accept: application/vnd.docker.distribution.manifest.v2+json
    GET <registry>/v2/<namespace>/<name>/blobs/<digest>      the layer's bytes (usually a redirect to a CDN)

Every layer lands in the store's `-partial` file first (a dropped connection resumes with Range) and is renamed into
place only after its sha256 matches the digest the manifest names. Ollama's layer media types
(`application/vnd.ollama.image.<kind>`) map onto the store's layers: `model` the GGUF weights, `template` (a Go
template: chat/go_templates.py renders those), `system`, `params` (JSON: checked like a Modelfile's PARAMETERs),
`messages`, `license`, `adapter` (a LoRA) and `projector` (a vision projector: the model then reads images). Any
other media type is refused, naming it. Plain http is used only for a loopback registry or when the pull says
`insecure`, as Ollama does. The manifest must arrive whole within LOCALLLM_PULL_TIMEOUT (pace.py); a layer is never
read past the size the manifest declares for it, and an adapter layer must fit the model as `create` checks it."""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

from pydantic import ValidationError

from .. import api, config
from ..errors import InvalidInput, InvalidName, ModelFormatError, ModelNotFound, NetworkError
from .adapters import check_adapter_fits
from .blobs import PartialBlob
from .catalog import did_you_mean
from .names import ModelRef, parse_digest
from .pace import Deadline
from .store import Store

log = logging.getLogger(__name__)

Progress = Iterator[api.PullProgress]

MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
OLLAMA_MEDIA = "application/vnd.ollama.image."
KINDS = ("model", "template", "system", "params", "license", "messages", "adapter", "projector")
TEXT_KINDS = ("template", "system", "params", "license", "messages")
MAX_MANIFEST_BYTES = 1 << 20
MAX_LAYERS = 64
MAX_TEXT_BYTES = 4 << 20  # one template, system prompt, license, params or messages layer
MAX_MESSAGES = 1024
RESOLUTION = "a stored model, a catalog name, hf.co/<org>/<repo>, a URL, a .gguf path, else the Ollama registry"


class Download(Protocol):
    """pull.download_url: appends the rest of `url` to `partial`, resuming a dropped connection (passed in, since
    pull.py dispatches to this module)."""

    def __call__(self, url: str, partial: PartialBlob, *, headers: dict[str, str]) -> Progress: ...


@dataclass(frozen=True)
class Layer:
    kind: str  # one of KINDS
    digest: str  # sha256-<hex>
    size: int


# ------------------------------------------------------------------------------------------------------- manifests


def parse_manifest(raw: bytes, origin: str) -> list[Layer]:
    """The layers of an Ollama manifest, each checked (media type, digest, size); `origin` names it in errors.

    Raises:
        ModelFormatError: not JSON, no layers, too many, an unknown media type, or not exactly one model layer.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ModelFormatError(f"the manifest of {origin} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError:
        raise ModelFormatError(f"the manifest of {origin} is not JSON") from None
    items = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise ModelFormatError(f"the manifest of {origin} has no layers")
    if len(items) > MAX_LAYERS:
        raise ModelFormatError(f"the manifest of {origin} has {len(items)} layers; at most {MAX_LAYERS} are read")
    layers = [_layer(item, origin) for item in items]
    models = [layer for layer in layers if layer.kind == "model"]
    if len(models) != 1:
        raise ModelFormatError(f"{origin} has {len(models)} model layers; localllm runs one GGUF file")
    return layers


def _layer(item: Any, origin: str) -> Layer:
    media = item.get("mediaType") if isinstance(item, dict) else None
    kind = media[len(OLLAMA_MEDIA) :] if isinstance(media, str) and media.startswith(OLLAMA_MEDIA) else None
    if kind not in KINDS:
        raise ModelFormatError(
            f"{origin} has a layer of media type {media!r}, which localllm cannot use",
            hint="supported layers: " + ", ".join(OLLAMA_MEDIA + k for k in KINDS),
        )
    try:
        digest = parse_digest(str(item.get("digest")))
    except InvalidName as exc:
        raise ModelFormatError(f"{origin}: a {kind} layer's {exc.message}") from None
    size = item.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ModelFormatError(f"{origin}: the {kind} layer {digest} has no valid size")
    if kind in TEXT_KINDS and size > MAX_TEXT_BYTES:
        raise ModelFormatError(f"{origin}: the {kind} layer is {size} bytes; at most {MAX_TEXT_BYTES} are read")
    return Layer(kind, digest, size)


def model_fields(layers: list[Layer], read: Callable[[Layer], bytes], origin: str) -> dict[str, Any]:
    """What Store.write_model takes from an Ollama model's small layers: template, system, parameters, messages,
    license (the last of each kind wins, licenses accumulate). `read` returns a layer's bytes."""
    texts: dict[str, list[str]] = {kind: [] for kind in TEXT_KINDS}
    for layer in layers:
        if layer.kind in TEXT_KINDS:
            try:
                texts[layer.kind].append(read(layer).decode("utf-8"))
            except UnicodeDecodeError:
                raise ModelFormatError(f"{origin}: the {layer.kind} layer is not UTF-8 text") from None
    fields: dict[str, Any] = {
        "template": _last(texts["template"]),
        "system": _last(texts["system"]),
        "license": texts["license"] or None,
    }
    params = _last(texts["params"])
    fields["parameters"] = parse_params(params, origin) if params is not None else None
    messages = _last(texts["messages"])
    fields["messages"] = parse_messages(messages, origin) if messages is not None else None
    return fields


def parse_params(text: str, origin: str) -> dict[str, Any]:
    """Ollama's params layer ({"stop": [...], "temperature": 0.6, ...}) as typed parameters. A name localllm does
    not know is dropped with a warning (Ollama adds options over time); a bad value of a known one is refused."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ModelFormatError(f"{origin}: the params layer is not JSON") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{origin}: the params layer is not a JSON object")
    known = api.LOAD_OPTION_NAMES | api.SAMPLING_OPTION_NAMES | api.IGNORED_OPTION_NAMES
    parameters: dict[str, Any] = {}
    for name, value in data.items():
        if name not in known:
            log.warning("%s: parameter %r has no meaning in localllm; ignored", origin, name)
            continue
        try:
            typed = _typed_stop(value) if name == "stop" else api.parse_option(name, value)
        except (InvalidInput, ValidationError) as exc:
            raise ModelFormatError(f"{origin}: the params layer's {name}: {_reason(exc)}") from None
        if typed is not None:
            parameters[name] = typed
    return parameters


def _typed_stop(value: Any) -> list[str]:
    return api.SamplingOptions.model_validate({"stop": value if isinstance(value, list) else [value]}).stop


def _reason(exc: Exception) -> str:
    return exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else getattr(exc, "message", str(exc))


def parse_messages(text: str, origin: str) -> list[api.Message]:
    try:
        data = json.loads(text)
    except ValueError:
        raise ModelFormatError(f"{origin}: the messages layer is not JSON") from None
    if not isinstance(data, list) or len(data) > MAX_MESSAGES:
        raise ModelFormatError(f"{origin}: the messages layer is not a list of at most {MAX_MESSAGES} messages")
    try:
        return [api.Message.model_validate(item) for item in data]
    except ValidationError as exc:
        raise ModelFormatError(f"{origin}: a message in the messages layer: {_reason(exc)}") from None


def _last(values: list[str]) -> str | None:
    return values[-1] if values else None


# ------------------------------------------------------------------------------------------------------- registry


def registry_base(ref: ModelRef, *, insecure: bool = False) -> str:
    """The registry a name is pulled from: its own host (https; http for loopback or `insecure`), or
    LOCALLLM_REGISTRY for a name without one.

    Raises:
        InvalidInput: the registry is plain http on a host that is not loopback, and the pull is not `insecure`.
    """
    if ref.hostless:
        base = config.REGISTRY.get()
    else:
        scheme = "http" if insecure or is_loopback(urlparse(f"//{ref.host}").hostname) else "https"
        base = f"{scheme}://{ref.host}"
    parsed = urlparse(base)
    if parsed.scheme == "http" and not insecure and not is_loopback(parsed.hostname):
        raise InvalidInput(
            f"the registry {base} is plain http, so what it sends could be changed on the way",
            hint="use an https registry, or pull with --insecure (insecure: true) to accept it",
        )
    return base


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RegistrySource:
    """A model in an Ollama-style registry; pulls it as `ollama pull` does."""

    def __init__(self, ref: ModelRef, download: Download, *, insecure: bool = False, stored: tuple[str, ...] = ()):
        self.ref = ref
        self.download = download
        self.insecure = insecure
        self.stored_name = ref.display
        self.origin = f"{ref.repository}:{ref.tag}"
        self._stored = stored  # for a "did you mean" when the registry has no such name

    def pull(self, store: Store) -> Progress:
        # Refusals (offline, no such name) come before the first progress line, so /api/pull answers them with a
        # status code and the CLI with one error line.
        stored = store.exists(self.stored_name)
        nowhere = f"model {self.stored_name!r} is not in the catalog" + ("" if stored else " or the store")
        base = registry_base(self.ref, insecure=self.insecure)
        if config.OFFLINE.get():
            if stored:
                yield api.PullProgress(status="pulling manifest")
                yield api.PullProgress(status="success")
                return
            raise ModelNotFound(  # not found where we may look: a 404, as a name missing from the registry is
                f"{nowhere}, and LOCALLLM_OFFLINE is set, so the registry {base} was not asked",
                hint=self._hint("unset LOCALLLM_OFFLINE (and HF_HUB_OFFLINE) to pull it"),
            )
        origin = f"{self.origin} at {base}"
        layers = parse_manifest(self._manifest(base, nowhere), origin)
        yield api.PullProgress(status="pulling manifest")
        try:
            yield from self._store_layers(store, base, layers, origin)
        except (ModelFormatError, InvalidInput):  # a refused model: its layers, though whole, are of no use
            store.discard_unnamed([layer.digest for layer in layers])
            raise
        yield api.PullProgress(status="success")

    def _store_layers(self, store: Store, base: str, layers: list[Layer], origin: str) -> Progress:
        with ExitStack() as pins:  # every layer is safe from `rm` and `prune` until the manifest names it
            for layer in layers:
                pins.enter_context(store.blobs.pin(layer.digest))
                yield from self._fetch_layer(store, base, layer)
            self._check_adapters(store, layers)
            fields = model_fields(layers, lambda layer: store.blobs.path(layer.digest).read_bytes(), origin)
            yield api.PullProgress(status="writing manifest")
            store.write_model(
                self.stored_name,
                weights=next(layer.digest for layer in layers if layer.kind == "model"),
                adapters=[layer.digest for layer in layers if layer.kind == "adapter"],
                projectors=[layer.digest for layer in layers if layer.kind == "projector"],
                source={"registry": base, "name": self.origin},
                **fields,
            )

    def _check_adapters(self, store: Store, layers: list[Layer]) -> None:
        weights = store.blobs.path(next(layer.digest for layer in layers if layer.kind == "model"))
        for layer in layers:
            if layer.kind == "adapter":
                check_adapter_fits(store.blobs.path(layer.digest), weights, self.stored_name, layer.digest)

    def _hint(self, otherwise: str) -> str:
        # A typo of a known name is the likelier story than a model the registry lacks.
        close = did_you_mean(self.stored_name, self._stored)
        return close or f"{otherwise}; `localllm ls --catalog` lists what pull fetches from the package index"

    def _manifest(self, base: str, nowhere: str) -> bytes:
        import httpx

        url = f"{base}/v2/{self.ref.repository}/manifests/{self.ref.tag}"
        deadline = Deadline()
        wait = min(60.0, deadline.seconds)
        try:
            with (
                httpx.Client(follow_redirects=True, timeout=httpx.Timeout(wait, connect=min(30.0, wait))) as client,
                client.stream("GET", url, headers={"Accept": MANIFEST_ACCEPT}) as response,
            ):
                if response.status_code == 404:
                    raise ModelNotFound(
                        f"{nowhere}, and the registry {base} has no {self.origin}",
                        hint=self._hint(f"names resolve as {RESOLUTION}"),
                    )
                if response.status_code in (401, 403):
                    raise NetworkError(
                        f"the registry {base} refused access to {self.origin} (HTTP {response.status_code})",
                        hint="localllm pulls public models only",
                    )
                if response.status_code != 200:
                    raise NetworkError(f"the registry {base} answered HTTP {response.status_code} for {self.origin}")
                return _bounded_body(response, f"the manifest of {self.origin}", deadline)
        except httpx.TransportError as exc:
            raise NetworkError(
                f"{nowhere}, and the registry {base} cannot be reached: {exc}",
                hint=self._hint("check the network and LOCALLLM_REGISTRY"),
            ) from None

    def _fetch_layer(self, store: Store, base: str, layer: Layer) -> Progress:
        label = f"pulling {layer.digest.removeprefix('sha256-')[:12]}"
        if store.blobs.has_trusted(layer.digest, layer.size):
            yield api.PullProgress(status=label, digest=layer.digest, total=layer.size, completed=layer.size)
            return
        url = f"{base}/v2/{self.ref.repository}/blobs/{layer.digest.replace('-', ':', 1)}"
        with store.blobs.open_partial(layer.digest, size=layer.size) as partial:
            yield api.PullProgress(status=label, digest=layer.digest, total=layer.size, completed=partial.completed)
            yield from self.download(url, partial, headers={})
            yield api.PullProgress(status="verifying sha256 digest", digest=layer.digest)
            partial.commit(f"the {layer.kind} layer of {self.origin}")


def _bounded_body(response, what: str, deadline: Deadline) -> bytes:
    """The body, refused past MAX_MANIFEST_BYTES or once the deadline passes (a server dripping bytes)."""
    body = bytearray()
    for block in response.iter_bytes():
        body += block
        if len(body) > MAX_MANIFEST_BYTES:
            raise ModelFormatError(f"{what} is over {MAX_MANIFEST_BYTES} bytes")
        if deadline.passed:
            raise NetworkError(
                f"{what} did not arrive within {deadline.seconds:g} s ({len(body)} bytes came); the pull stopped",
                hint="try again later; on a slow link raise LOCALLLM_PULL_TIMEOUT",
            )
    return bytes(body)
