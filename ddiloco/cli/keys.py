"""`ddiloco keys`: what a learner pod is given instead of the run's master key (`ddiloco.protocol.rolekeys`).

Reads the master key from `DDILOCO_RUN_KEY` (or `--key-file`, e.g. the `WORKDIR/RUN_ID.key` of `ddiloco
run`) and prints the learner's share as JSON: the entries of the learner Secret (`learner`, `syncer_pub`)
and the environment they become. Nothing secret beyond the learner's share is printed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddiloco.cli.args import emit
from ddiloco.errors import ConfigError
from ddiloco.protocol import signing


def cmd_keys(args: argparse.Namespace) -> int:
    if args.key_file:
        master = signing.parse_key(Path(args.key_file).read_text(), args.key_file)
    else:
        master = signing.key_from_env()
        if not isinstance(master, bytes):
            raise ConfigError(f"set {signing.ENV_VAR} to the run's master key, or pass --key-file")
    env = signing.learner_env(master)
    secret = {"learner": env[signing.LEARNER_KEY_VAR], "syncer_pub": env[signing.SYNCER_PUBKEY_VAR]}
    line = "kubectl create secret generic ddiloco-learner-key " + " ".join(
        f"--from-literal={k}=$(ddiloco keys | jq -r .secret.{k})" for k in secret
    )
    return emit({"secret": secret, "env": env}, line)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="print a learner pod's share of the run key (learner key, syncer public key)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--key-file", help="the master key (hex) in a file; default: DDILOCO_RUN_KEY")
    p.set_defaults(func=cmd_keys)
