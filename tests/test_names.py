"""The model-name grammar of names.py, table-driven: what parses to what, and what is refused before a path is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm.errors import InvalidName
from localllm.models.names import parse_digest, parse_ref

HEX = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

VALID = [
    # text                               kind     display                          manifest parts
    ("smollm2:135m", "short", "smollm2:135m", ("localllm", "library", "smollm2", "135m")),
    ("smollm2", "short", "smollm2:latest", ("localllm", "library", "smollm2", "latest")),
    ("SmolLM2:135M", "short", "smollm2:135m", ("localllm", "library", "smollm2", "135m")),
    ("  smollm2:135m  ", "short", "smollm2:135m", ("localllm", "library", "smollm2", "135m")),
    ("library/smollm2:135m", "short", "smollm2:135m", ("localllm", "library", "smollm2", "135m")),
    ("me/coder:v1", "short", "me/coder:v1", ("localllm", "me", "coder", "v1")),
    (
        "registry.example/me/coder:v1.2",
        "short",
        "registry.example/me/coder:v1.2",
        ("registry.example", "me", "coder", "v1.2"),
    ),
    ("localhost:5000/me/coder", "short", "localhost:5000/me/coder:latest", ("localhost_5000", "me", "coder", "latest")),
    ("gemma-3_270m.it:q4_k_m", "short", "gemma-3_270m.it:q4_k_m", ("localllm", "library", "gemma-3_270m.it", "q4_k_m")),
    ("model.gguf", "short", "model.gguf:latest", ("localllm", "library", "model.gguf", "latest")),
    ("hf.co/Org/Repo-GGUF", "hf", "hf.co/Org/Repo-GGUF", ("hf.co", "org", "repo-gguf", "latest")),
    ("hf.co/Org/Repo-GGUF:Q4_K_M", "hf", "hf.co/Org/Repo-GGUF:Q4_K_M", ("hf.co", "org", "repo-gguf", "q4_k_m")),
    ("huggingface.co/org/repo:q8_0", "hf", "hf.co/org/repo:q8_0", ("hf.co", "org", "repo", "q8_0")),
    ("a" * 80, "short", "a" * 80 + ":latest", ("localllm", "library", "a" * 80, "latest")),
]


@pytest.mark.parametrize("text, kind, display, parts", VALID)
def test_valid_names_parse(text, kind, display, parts):
    ref = parse_ref(text)
    assert (ref.kind, ref.display, ref.manifest_parts) == (kind, display, parts)
    assert parse_ref(ref.display).manifest_parts == parts  # the display form parses back to the same model


def test_hf_names_differing_in_case_share_one_manifest():
    assert parse_ref("hf.co/Org/Repo:Q4_K_M").manifest_parts == parse_ref("hf.co/org/repo:q4_k_m").manifest_parts


def test_hf_default_quant_is_not_explicit():
    assert not parse_ref("hf.co/org/repo").explicit_tag
    assert parse_ref("hf.co/org/repo:Q8_0").tag == "Q8_0"


@pytest.mark.parametrize(
    "text, path",
    [
        ("./models/x.gguf", Path("models/x.gguf")),
        ("/abs/dir/Model.Q4.GGUF", Path("/abs/dir/Model.Q4.GGUF")),
        ("../up/x.gguf", Path("../up/x.gguf")),
        ("dir/x.gguf", Path("dir/x.gguf")),
    ],
)
def test_gguf_paths_are_files(text, path):
    ref = parse_ref(text)
    assert ref.kind == "file" and ref.path == path


def test_home_paths_expand():
    assert parse_ref("~/x.gguf").path == Path.home() / "x.gguf"


def test_a_file_path_has_no_manifest():
    with pytest.raises(InvalidName, match="file path"):
        _ = parse_ref("./x.gguf").manifest_parts


INVALID = [
    ("", "empty"),
    ("   ", "empty"),
    ("../etc/passwd", "host '..'"),
    ("../../x", "host '..'"),
    ("a/../../b", "too many parts"),
    ("me/..", "name '..'"),
    ("smollm2:..", "tag '..'"),
    ("smollm2:../x", "not valid"),
    ("a..b", "name 'a..b'"),
    ("/etc/passwd", "not valid"),
    ("\\\\server\\share", "not valid"),
    ("a//b", "not valid"),
    ("a/b/c/d", "too many parts"),
    ("name:", "tag ''"),
    ("name:tag:more", "not valid"),
    (":tag", "name ''"),
    ("me/", "name ''"),
    ("-name", "name '-name'"),
    (".hidden", "name '.hidden'"),
    ("with space", "not valid"),
    ("tab\tname", "not valid"),
    ("nul\x00byte", "not valid"),
    ("modèle", "not valid"),
    ("semi;colon", "not valid"),
    ("a" * 81, "not valid"),
    ("x" * 257, "257 characters"),
    ("me/" + "a" * 81 + ":t", "not valid"),
    ("bad_host!/me/model", "host"),
    ("hf.co/org", "not a Hugging Face name"),
    ("hf.co/org/repo/extra", "not a Hugging Face name"),
    ("hf.co/../repo", "organisation '..'"),
    ("hf.co/org/..", "repository '..'"),
    ("hf.co/org/repo:Q4/../x", "not a Hugging Face name"),
]


@pytest.mark.parametrize("text, message", INVALID)
def test_invalid_names_are_refused_with_a_message(text, message):
    with pytest.raises(InvalidName) as caught:
        parse_ref(text)
    assert message in str(caught.value)


@pytest.mark.parametrize("text", ["sha256-" + HEX, "sha256:" + HEX, f"  sha256-{HEX} "])
def test_valid_digests_are_canonical(text):
    assert parse_digest(text) == "sha256-" + HEX


@pytest.mark.parametrize(
    "text",
    [
        "",
        HEX,
        "sha256-" + HEX.upper(),
        "sha256-" + HEX[:-1],
        "sha256-" + HEX + "0",
        "sha512-" + HEX,
        "sha256-../../etc/passwd",
        "sha256-" + HEX[:-1] + "g",
        "sha256_" + HEX,
        "sha256-" + HEX + "/x",
    ],
)
def test_invalid_digests_are_refused(text):
    with pytest.raises(InvalidName, match="digest"):
        parse_digest(text)
