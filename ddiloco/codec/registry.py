"""Codecs by name: the one table that config checks, learners, the syncer and the bandwidth planner read.

The built-in families register at import, in this order: `ddiloco.codec.float` (fp32, bf16) and
`ddiloco.codec.blockwise` (int8, int4, int2). Another codec is one `Codec` subclass or instance in a file of
its own, made known with `register` (and `unregister`, as tests do). A codec is for uploads
(`diloco.codec`), download deltas (`diloco.download_codec`, `ddiloco.run.downlink`) or both; `NONE` as a
download codec means full versions only. `CODECS` is the built-in upload codecs' names (command-line
choices); checks read `names`, so a codec registered later counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from ddiloco.codec import blockwise
from ddiloco.codec import float as floats
from ddiloco.codec.base import BLOCK, Codec

NONE = "none"
"""`diloco.download_codec` for no download deltas: learners fetch every new version whole."""
ROLES = ("upload", "download")

_CODECS: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Make `codec` known by its name; ``ValueError`` when the name is taken (or is `NONE`)."""
    if not isinstance(codec, Codec):
        raise TypeError(f"register expects a Codec, got {type(codec).__name__}")
    if codec.name in _CODECS or codec.name == NONE:
        raise ValueError(f"a codec named {codec.name!r} is registered already")
    _CODECS[codec.name] = codec
    return codec


def unregister(name: str) -> None:
    """Forget the codec named `name` (``KeyError`` when there is none)."""
    del _CODECS[name]


def names(role: str | None = None) -> tuple[str, ...]:
    """Names of the registered codecs, in registration order: all, or those for `role` (upload, download)."""
    if role is None:
        return tuple(_CODECS)
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return tuple(n for n, c in _CODECS.items() if getattr(c, role))


def get(name: str, role: str | None = None) -> Codec:
    """The codec named `name` (for `role` when given); ``ValueError`` listing the choices otherwise."""
    choices = names(role)
    if name not in choices:
        what = f"{role} codec" if role else "codec"
        raise ValueError(f"unknown {what} {str(name)[:40]!r}; expected one of {', '.join(choices)}")
    return _CODECS[name]


def download_choices() -> tuple[str, ...]:
    """What `diloco.download_codec` may be: `NONE` or a download codec."""
    return (NONE, *names("download"))


def publishes_deltas(download_codec: str) -> bool:
    """Whether the syncer publishes download deltas under `download_codec` (anything but `NONE`)."""
    return download_codec != NONE


def encode(x: Tensor, codec: str, *, block: int = BLOCK) -> dict[str, Tensor]:
    """`Codec.encode` of the codec named `codec`."""
    return get(codec).encode(x, block=block)


def decode(
    parts: Mapping[str, Tensor],
    codec: str,
    shape: Sequence[int],
    *,
    block: int = BLOCK,
    out: Tensor | None = None,
) -> Tensor:
    """`Codec.decode` of the codec named `codec`."""
    return get(codec).decode(parts, shape, block=block, out=out)


def encoded_nbytes(numel: int, codec: str, *, block: int = BLOCK) -> int:
    """`Codec.nbytes` of the codec named `codec`."""
    return get(codec).nbytes(numel, block=block)


for _codec in (*floats.FAMILY, *blockwise.FAMILY):
    register(_codec)
CODECS = names("upload")
"""The built-in upload codecs' names."""
