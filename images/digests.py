"""Base and object-store images by digest: list the image references of images/*.Dockerfile and manifests/, and
pin each tag to the digest its registry serves now (`repo:tag` -> `repo:tag@sha256:...`, the tag kept for
people; the digest is what a builder or kubelet pulls).

    python3 images/digests.py            # every reference, pinned or not (exit 1 if any is unpinned)
    python3 images/digests.py pin        # ask the registries (HTTP API v2, anonymous) and rewrite the files

Design choices:
- Standard library only, runnable before anything is installed, like components/images.py.
- The digest pinned is the one the registry returns for the tag as it is (for a multi-platform image, its index:
  the builder still picks the platform), read from `Docker-Content-Digest` of a HEAD on the manifest, with the
  anonymous bearer token the registry's 401 names (Docker Hub, ghcr.io and quay.io all answer that way).
- References are found where they are written: `ARG NAME=ref` defaults used by `FROM ${NAME}`, literal `FROM ref`,
  and `image:` fields of the YAML under manifests/ (tests/unit/test_image_digests.py checks the same list).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_ACCEPT = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    )
)


def references(root: Path = ROOT) -> dict[str, list[str]]:
    """Image reference -> the files (relative) that name it."""
    found: dict[str, list[str]] = {}

    def add(ref: str, path: Path) -> None:
        found.setdefault(ref, []).append(path.relative_to(root).as_posix())

    for path in sorted((root / "images").glob("*.Dockerfile")):
        text = path.read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
        stages = set(re.findall(r"^FROM \S+ AS (\S+)", text, re.M | re.I))
        for ref in re.findall(r"^FROM (\S+)", text, re.M):
            m = re.fullmatch(r"\$\{?(\w+)\}?", ref)
            ref = args[m[1]] if m else ref
            if ref not in stages:
                add(ref, path)
    for path in sorted((root / "manifests").rglob("*.yaml")):
        for ref in re.findall(r"^\s*(?:-\s*)?image:\s*[\"']?([^\"'\s#]+)", path.read_text(), re.M):
            add(ref, path)
    return found


def split(ref: str) -> tuple[str, str, str]:
    """`[registry/]repo:tag[@digest]` -> (registry host, repository, tag), Docker Hub's defaults filled in."""
    ref = ref.split("@")[0]
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first, rest, tag
    return "registry-1.docker.io", name if "/" in name else f"library/{name}", tag


def _token(challenge: str) -> str:
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    query = urllib.parse.urlencode({k: v for k, v in params.items() if k in ("service", "scope")})
    with urllib.request.urlopen(f"{params['realm']}?{query}", timeout=30) as r:
        body = json.load(r)
    return body.get("token") or body["access_token"]


def resolve(ref: str) -> str:
    """The registry's current digest of the reference's tag (`sha256:...`)."""
    host, repo, tag = split(ref)
    url = f"https://{host}/v2/{repo}/manifests/{tag}"
    headers = {"Accept": _ACCEPT}
    for _ in range(2):
        request = urllib.request.Request(url, method="HEAD", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.headers["Docker-Content-Digest"]
        except urllib.error.HTTPError as e:
            if e.code != 401 or "Authorization" in headers:
                raise
            headers["Authorization"] = f"Bearer {_token(e.headers['WWW-Authenticate'])}"
    raise AssertionError("unreachable")


def pin(text: str, ref: str, digest: str) -> str:
    """`text` with each whole occurrence of `ref` (a tag, or a tag with an old digest) naming `digest`."""
    tagged = ref.split("@")[0]
    pattern = re.compile(rf"(?<![\w./:-]){re.escape(tagged)}(?:@sha256:[0-9a-f]{{64}})?(?![\w./:@-])")
    return pattern.sub(f"{tagged}@{digest}", text)


def main(argv: list[str]) -> int:
    refs = references()
    if argv[:1] == ["pin"]:
        for ref, files in refs.items():
            digest = resolve(ref)
            for rel in sorted(set(files)):
                path = ROOT / rel
                path.write_text(pin(path.read_text(), ref, digest))
            print(f"{ref.split('@')[0]}@{digest}  ({', '.join(sorted(set(files)))})")
        return 0
    unpinned = [ref for ref in refs if not DIGEST.search(ref)]
    for ref, files in refs.items():
        print(f"{'pinned  ' if DIGEST.search(ref) else 'UNPINNED'} {ref}  ({', '.join(sorted(set(files)))})")
    return 1 if unpinned else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
