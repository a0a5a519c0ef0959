#!/usr/bin/env bash
# Build (and push) the ddiloco images with an immutable tag, VERSION-DIGEST (package version + 12 hex digits
# of a hash of the sources the images install, components/images.py), the tag the compiled pipeline
# (`ddiloco pipeline compile --registry REGISTRY`) names for the same tree:
#   REGISTRY/ddiloco-learner:TAG   CUDA PyTorch   (images/learner.Dockerfile)
#   REGISTRY/ddiloco-syncer:TAG    CPU PyTorch    (images/syncer.Dockerfile)
#
# usage: images/build.sh REGISTRY [--push] [--only learner|syncer] [--platform linux/amd64] [--dry-run]
#   DOCKER=podman images/build.sh ...   to use another builder CLI
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
registry="${1%/}"; shift
[ -n "$registry" ] && [ "${registry#-}" = "$registry" ] || usage
push=0; only=""; platform=""; dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=1 ;;
    --only) only="$2"; shift ;;
    --platform) platform="$2"; shift ;;
    --dry-run) dry=1 ;;
    *) usage ;;
  esac
  shift
done

version="$(python3 components/images.py tag)"
[ -n "$version" ] || { echo "cannot compute the image tag (python3 components/images.py tag)" >&2; exit 1; }
docker="${DOCKER:-docker}"

run() { echo "+ $*"; [ "$dry" = 1 ] || "$@"; }

for name in learner syncer; do
  [ -z "$only" ] || [ "$only" = "$name" ] || continue
  tag="$registry/ddiloco-$name:$version"
  args=(build -f "images/$name.Dockerfile" -t "$tag")
  [ -z "$platform" ] || args+=(--platform "$platform")
  run "$docker" "${args[@]}" .
  [ "$push" = 0 ] || run "$docker" push "$tag"
done
echo "compile the pipeline for these images: ddiloco pipeline compile --registry $registry"
