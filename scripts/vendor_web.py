"""Refresh the web page's vendored libraries in localllm/web/vendor/ from their published npm packages.

The page ships these as built files (no build step, no npm at set-up): a markdown parser (marked), an HTML sanitiser
(DOMPurify) and a syntax highlighter (highlight.js core with a few languages). Each package is pinned by version and
by the sha256 of its tarball; a tarball with other bytes stops the refresh before anything is copied. The files are
copied as published, with each package's licence beside them.

    python scripts/vendor_web.py            # fetch with `npm pack`, verify, copy (needs npm)
    python scripts/vendor_web.py --check    # fetch and verify, and say which vendored files differ; copy nothing

To move a package to a new version: change its version, run once to read the new tarball's sha256 in the error,
check the release, pin that sha256 and run again."""

from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

VENDOR = Path(__file__).resolve().parent.parent / "localllm" / "web" / "vendor"
# The languages a model's code blocks are most often in; any other block is shown plain.
HLJS_LANGUAGES = (
    "bash",
    "c",
    "cpp",
    "css",
    "diff",
    "go",
    "java",
    "javascript",
    "json",
    "markdown",
    "python",
    "rust",
    "shell",
    "sql",
    "typescript",
    "xml",
    "yaml",
)


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str  # of the tarball `npm pack` fetches
    files: dict[str, str]  # member inside the tarball's package/ -> file under vendor/

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"


PACKAGES = (
    Package(
        "marked",
        "18.3.0",
        "ac4b23ef5425d83f7aad00a81640d29e5b0fd81a6361a30fa96b4b8bb228ad24",
        {"lib/marked.esm.js": "marked.esm.js", "LICENSE": "LICENSE.marked"},
    ),
    Package(
        "dompurify",
        "3.5.0",
        "faa5f2bfe2814384b83d6edb4ed66812fbfdb2a654b4d59edd4b12304058ec20",
        {"dist/purify.es.mjs": "purify.es.mjs", "LICENSE": "LICENSE.dompurify"},
    ),
    Package(
        "@highlightjs/cdn-assets",
        "11.11.1",
        "28a06bf6ebcc2218c6e842bdb4f1c8353508a8cada59e85110f91892f5726195",
        {
            "es/core.min.js": "highlight/core.min.js",
            "styles/github.min.css": "highlight/github.min.css",
            "styles/github-dark.min.css": "highlight/github-dark.min.css",
            "LICENSE": "LICENSE.highlight.js",
            **{f"es/languages/{lang}.min.js": f"highlight/languages/{lang}.min.js" for lang in HLJS_LANGUAGES},
        },
    ),
)


def fetch(package: Package, workdir: Path) -> bytes:
    """The package's tarball, by `npm pack` (npm's own configuration decides where it comes from)."""
    done = subprocess.run(
        ["npm", "pack", package.spec, "--silent", "--pack-destination", str(workdir)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"npm pack {package.spec} failed: {done.stderr.strip()}")
    return (workdir / done.stdout.strip().splitlines()[-1]).read_bytes()


def verified(package: Package, tarball: bytes) -> bytes:
    digest = hashlib.sha256(tarball).hexdigest()
    if digest != package.sha256:
        sys.exit(
            f"{package.spec}: the tarball's sha256 is {digest}, the pin says {package.sha256}; "
            "check the release before pinning the new digest"
        )
    return tarball


def members(package: Package, tarball: bytes) -> dict[str, bytes]:
    """vendor/ path -> bytes, for each file the package pins."""
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        for member, target in package.files.items():
            extracted = archive.extractfile(f"package/{member}")
            if extracted is None:
                sys.exit(f"{package.spec} has no file package/{member}")
            found[target] = extracted.read()
    return found


def same_file(path: Path, data: bytes) -> bool:
    return path.is_file() and path.read_bytes() == data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify and compare only; copy nothing")
    args = parser.parse_args()
    wanted: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for package in PACKAGES:
            wanted.update(members(package, verified(package, fetch(package, Path(tmp)))))
    if args.check:
        stale = sorted(target for target, data in wanted.items() if not same_file(VENDOR / target, data))
        print("\n".join(f"differs: vendor/{t}" for t in stale) or f"all {len(wanted)} vendored files match their pins")
        sys.exit(1 if stale else 0)
    for target, data in wanted.items():
        path = VENDOR / target
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    print(f"{len(wanted)} files in {VENDOR}: " + ", ".join(p.spec for p in PACKAGES))


if __name__ == "__main__":
    main()
