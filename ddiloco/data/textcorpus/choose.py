"""The tokenizer `ddiloco tokenize --tokenizer` names: bytes, a model directory's, or a tokenizer JSON file.

Design choices:
- `auto` (the default) is the `--model-hf` directory's tokenizer when given, else bytes, as `prepare`'s
  `data.tokenizer=auto` decides; `model` insists on the directory's. The directory is read with the same
  code `prepare` uses (`ddiloco.model.hf.source.model_dir`, `ddiloco.data.hf_tokenizer.load_model_tokenizer`).
- A PATH is a file: the tokenizer JSON a prepared run stores (`Tokenizer.to_json`, with a "type"), or a
  `tokenizers` tokenizer.json holding `<eos>` and `<pad>` (a byte-level BPE as `train_bpe` makes it); or a
  directory holding a model's tokenizer files.
- `bpe` is refused: it is trained on the whole corpus, which a streaming tokenizer never holds; train it
  with `ddiloco prepare` (or `ddiloco.data.tokenizer.train_bpe` on a sample) and pass its JSON file.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddiloco.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, tokenizer_from_json
from ddiloco.errors import CorpusError

_MAX_JSON_BYTES = 256 << 20


def tokenizer_from_spec(spec: str, model_hf: str | None = None) -> Tokenizer:
    """The tokenizer `spec` names (byte, auto, model, bpe, or a PATH); `model_hf`: a model directory."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        raise CorpusError(
            "--tokenizer bpe: BPE is trained on the whole corpus, which tokenize streams and never holds; "
            "use --tokenizer byte or model, or a tokenizer.json (e.g. the one `ddiloco prepare` stored)"
        )
    if spec in ("auto", "model"):
        if model_hf:
            return _model_tokenizer(model_hf, required=spec == "model") or ByteTokenizer()
        if spec == "model":
            raise CorpusError(
                "--tokenizer model needs --model-hf DIR (a model directory with tokenizer files)"
            )
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        return _model_tokenizer(str(path), required=True)  # type: ignore[return-value]
    if not path.is_file():
        raise CorpusError(
            f"--tokenizer {spec!r} is neither byte, model, auto nor an existing file or directory; pass one"
        )
    return _from_file(path)


def _model_tokenizer(model_hf: str, *, required: bool) -> Tokenizer | None:
    from ddiloco.data.hf_tokenizer import TOKENIZER_FILES, has_tokenizer, load_model_tokenizer
    from ddiloco.model.hf.source import model_dir

    path = model_dir(model_hf)
    if has_tokenizer(path):
        return load_model_tokenizer(path)
    if required:
        raise CorpusError(
            f"{path} has none of {', '.join(TOKENIZER_FILES)}; add them or use --tokenizer byte"
        )
    return None


def _from_file(path: Path) -> Tokenizer:
    with open(path, "rb") as f:
        data = f.read(_MAX_JSON_BYTES + 1)
    if len(data) > _MAX_JSON_BYTES:
        raise CorpusError(f"{path}: larger than {_MAX_JSON_BYTES} bytes; not a tokenizer JSON")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorpusError(f"{path}: not JSON ({e}); pass a tokenizer.json") from e
    if isinstance(obj, dict) and "type" in obj and obj["type"] in ("byte", "bpe", "model"):
        return tokenizer_from_json(data.decode())
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return BPETokenizer(HFTokenizer.from_str(data.decode()))
    except Exception as e:  # the Rust side raises plain Exception; BPETokenizer raises ValueError
        raise CorpusError(
            f"{path}: not a ddiloco tokenizer JSON nor a tokenizers JSON with <eos> and <pad> ({e}); for a "
            "model's tokenizer pass its directory"
        ) from e
