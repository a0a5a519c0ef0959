"""Codecs by name: the one table that config checks, learners, the syncer and the bandwidth planner read.

The built-in families register at import, in this order: `ddiloco.codec.float` (fp32, bf16) and
`ddiloco.codec.blockwise` (int8, int4, int2). Another codec is one `Codec` subclass or instance in a file of
its own, made known with `register` (and `unregister`, as tests do). A codec is for uploads
(`diloco.codec`), download deltas (`diloco.download_codec`, `ddiloco.run.downlink`) or both; `NONE` as a
download codec means full versions only. `CODECS` is the built-in upload codecs' names; checks read
`names`, so a codec registered later counts. The families import torch: they are imported on the table's
first use, not with this module, so a command that reads no codec (`ddiloco simulate goodput`, `--version`)
starts without torch; `Names` are command-line choices that look the table up only when an argument is given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from ddiloco.codec.base import Codec

NONE = "none"
"""`diloco.download_codec` for no download deltas: learners fetch every new version whole."""
ROLES = ("upload", "download")

_CODECS: dict[str, Codec] = {}
_BUILTIN: tuple[str, ...] = ()


def _table() -> dict[str, Codec]:
    """The registered codecs, the built-in families first (imported here, on first use: every function that
    reads or changes the table comes through here, so nothing is registered before them)."""
    global _BUILTIN
    if not _BUILTIN:
        from ddiloco.codec import blockwise
        from ddiloco.codec import float as floats

        family = (*floats.FAMILY, *blockwise.FAMILY)
        _BUILTIN = tuple(c.name for c in family)
        _CODECS.update((c.name, c) for c in family)
    return _CODECS


def register(codec: Codec) -> Codec:
    """Make `codec` known by its name; ``ValueError`` when the name is taken (or is `NONE`)."""
    from ddiloco.codec.base import Codec

    if not isinstance(codec, Codec):
        raise TypeError(f"register expects a Codec, got {type(codec).__name__}")
    if codec.name in _table() or codec.name == NONE:
        raise ValueError(f"a codec named {codec.name!r} is registered already")
    _CODECS[codec.name] = codec
    return codec


def unregister(name: str) -> None:
    """Forget the codec named `name` (``KeyError`` when there is none)."""
    del _table()[name]


def names(role: str | None = None) -> tuple[str, ...]:
    """Names of the registered codecs, in registration order: all, or those for `role` (upload, download)."""
    if role is None:
        return tuple(_table())
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return tuple(n for n, c in _table().items() if getattr(c, role))


def get(name: str, role: str | None = None) -> Codec:
    """The codec named `name` (for `role` when given); ``ValueError`` listing the choices otherwise."""
    choices = names(role)
    if name not in choices:
        what = f"{role} codec" if role else "codec"
        raise ValueError(f"unknown {what} {str(name)[:40]!r}; expected one of {', '.join(choices)}")
    return _table()[name]


class Names:
    """The names of the codecs for `role` (all when None), looked up when asked: command-line choices
    (give the argument a `metavar`, else argparse lists them while the parser is built)."""

    def __init__(self, role: str | None = None) -> None:
        self.role = role

    def __iter__(self) -> Iterator[str]:
        return iter(names(self.role))

    def __contains__(self, name: object) -> bool:
        return name in names(self.role)

    def __len__(self) -> int:
        return len(names(self.role))


def download_choices() -> tuple[str, ...]:
    """What `diloco.download_codec` may be: `NONE` or a download codec."""
    return (NONE, *names("download"))


def publishes_deltas(download_codec: str) -> bool:
    """Whether the syncer publishes download deltas under `download_codec` (anything but `NONE`)."""
    return download_codec != NONE


def encode(x: Tensor, codec: str, **options: Any) -> dict[str, Tensor]:
    """`Codec.encode` of the codec named `codec` (options: `block`)."""
    return get(codec).encode(x, **options)


def decode(parts: Mapping[str, Tensor], codec: str, shape: Sequence[int], **options: Any) -> Tensor:
    """`Codec.decode` of the codec named `codec` (options: `block`, `out`)."""
    return get(codec).decode(parts, shape, **options)


def encoded_nbytes(numel: int, codec: str, **options: Any) -> int:
    """`Codec.nbytes` of the codec named `codec` (options: `block`)."""
    return get(codec).nbytes(numel, **options)


def __getattr__(name: str) -> Any:
    if name == "CODECS":  # the built-in upload codecs' names
        table = _table()
        return tuple(n for n in _BUILTIN if n in table and table[n].upload)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
