"""Joining a run from elsewhere: `ddiloco learner --join URL --site NAME` from another cluster or region.

A learner only needs the run's bucket: every exchange goes through the store. So a second cluster (another
Kubeflow install, another region, a laptop) adds learners to a run owned by a first one by pointing them at
the same run root with its own credentials. Ids 0..M−1 belong to the owner; a joiner claims the first id
above every id seen, by writing a claim of its own, waiting and listing (no conditional put needed); a
race leaves the id burnt and both joiners move on. `--join-name` makes a joined learner restartable on its
id, `--site` labels its reports and metrics, and `--link-bandwidth` / `--link-latency` shape its link.

Design notes (the claim protocol and what it needs of the store): docs/internals.md,
"Joining a run from elsewhere".
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import secrets
import time
from collections.abc import Callable, Mapping

from ddiloco import keys
from ddiloco.config.link import LinkConfig
from ddiloco.errors import ConfigError
from ddiloco.platform.hostname import host_name
from ddiloco.store.base import Store, StoreConfigError
from ddiloco.store.shaped import Link, shape

log = logging.getLogger(__name__)

SITE_ENV = "DDILOCO_SITE"
DEFAULT_SITE = "local"
_SITE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_site(site: str) -> str:
    """A site name is a short label (it becomes a Prometheus label value and a report column)."""
    if not isinstance(site, str) or not _SITE_RE.fullmatch(site):
        raise ConfigError(
            f"bad site {site!r}: use 1-63 characters [A-Za-z0-9._-] starting with a letter or digit, "
            f"e.g. eu-west or dc2"
        )
    return site


def default_site(env: Mapping[str, str] | None = None) -> str:
    return check_site((os.environ if env is None else env).get(SITE_ENV) or DEFAULT_SITE)


def _ids_and_claims(store: Store) -> tuple[set[int], dict[tuple[str, str], int]]:
    """Learner ids with any object in the store, and named claims: (site, name) -> id."""
    used: set[int] = set()
    named: dict[tuple[str, str], int] = {}
    for key in store.list(keys.LEARNERS):
        parts = key[len(keys.LEARNERS) :].split("/")
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        lid = int(parts[0])
        used.add(lid)
        if key.startswith(keys.claim_prefix(lid)) and key.endswith(".json"):
            claim = store.get_json_or_none(key)
            if isinstance(claim, dict) and claim.get("name") and claim.get("won"):
                named.setdefault((str(claim.get("site")), str(claim["name"])), lid)
    return used, named


def reserved_ids(store: Store) -> int:
    """Ids below this belong to the run's owner: its M learners and any learner its chaos schedule adds."""
    from ddiloco.config.chaos_schedule import schedule_from_config
    from ddiloco.run.root import RunRoot

    cfg = RunRoot.read_config(store)
    added = [
        e.learner for e in schedule_from_config(cfg.chaos, cfg.diloco.learners) if e.kind == "add_learner"
    ]
    return max([cfg.diloco.learners - 1, *(i for i in added if i is not None)]) + 1


def claim_learner_id(
    store: Store,
    site: str,
    *,
    name: str | None = None,
    provisioned: int | None = None,
    settle_s: float = 1.0,
    attempts: int = 20,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> int:
    """Pick and claim a learner id no other learner uses (see the module docstring); returns it."""
    check_site(site)
    if name is not None and not _NAME_RE.fullmatch(name):
        raise ConfigError(f"bad --join-name {name!r}: use 1-128 characters [A-Za-z0-9._-]")
    if provisioned is None:
        provisioned = reserved_ids(store)
    rng = rng or random.Random()
    for attempt in range(attempts):
        used, named = _ids_and_claims(store)
        if name is not None and (site, name) in named:
            lid = named[(site, name)]
            log.info("join: %s/%s takes its learner id %d again", site, name, lid)
            return lid
        lid = max(used | {provisioned - 1}) + 1
        nonce = f"{time.time_ns():x}-{secrets.token_hex(4)}"
        claim = {
            "site": site,
            "name": name,
            "host": host_name(),
            "pid": os.getpid(),
            "time": time.time(),
        }
        store.put_json(keys.claim_key(lid, nonce), claim)
        sleep(settle_s)
        others = [k for k in store.list(keys.learner_prefix(lid)) if k != keys.claim_key(lid, nonce)]
        if not others:
            store.put_json(keys.claim_key(lid, nonce), {**claim, "won": True})
            log.info("join: site %s claimed learner id %d", site, lid)
            return lid
        log.info("join: learner id %d is contended (%d other objects); trying the next one", lid, len(others))
        sleep(rng.uniform(0.0, settle_s) * (1 + attempt % 4))
    raise StoreConfigError(f"join: no free learner id after {attempts} attempts; is the store listing stale?")


def link_for(store: Store, bandwidth: str | None = None, latency: str | None = None) -> Link | None:
    """This learner's link: `bandwidth` / `latency` when either is given, else the run's `link` section."""
    if bandwidth is not None or latency is not None:
        cfg = LinkConfig(bandwidth=bandwidth, latency=latency)
        cfg.validate()
    else:
        from ddiloco.run.root import RunRoot

        cfg = RunRoot.read_config(store).link
    return Link.from_config(cfg)


def shape_learner_store(store: Store, bandwidth: str | None = None, latency: str | None = None) -> Store:
    """A learner's (prepared, chaos-wrapped) store behind its link (`link_for`); itself when unlimited."""
    return shape(store, link_for(store, bandwidth, latency))


def learner_id_for(store: Store, learner_id: int | None, site: str, name: str | None = None) -> int:
    """`learner_id` when given (it must be ≥ 0), else a freshly claimed one."""
    if learner_id is not None:
        if learner_id < 0:
            raise ConfigError(f"--learner-id {learner_id} must be ≥ 0")
        return learner_id
    return claim_learner_id(store, site, name=name)


def add_learner_args(p: argparse.ArgumentParser) -> None:
    """The learner's join, site and link flags (`ddiloco learner`)."""
    p.add_argument(
        "--join",
        metavar="URL",
        default=None,
        help="run root of an existing run to join from elsewhere (s3://bucket/prefix/RUN_ID, file:///dir/RUN_ID); "
        "instead of --store; picks a free learner id unless --learner-id is given",
    )
    p.add_argument(
        "--site",
        default=None,
        help=f"where this learner runs (reports, metrics, summary by site); default ${SITE_ENV} or {DEFAULT_SITE}",
    )
    p.add_argument(
        "--join-name",
        default=None,
        help="stable name of a joined learner: a restart with the same --site and name takes the same id back",
    )
    p.add_argument("--link-bandwidth", default=None, help="this learner's link, per direction, e.g. 10Mbit")
    p.add_argument("--link-latency", default=None, help="this learner's added one-way latency, e.g. 50ms")


def resolve_args(args: argparse.Namespace) -> tuple[str, str]:
    """(run root URL, site) from `ddiloco learner` arguments; exactly one of --store / --join."""
    if (args.store is None) == (args.join is None):
        raise ConfigError(
            "give exactly one of --store URL (a learner of this run) or --join URL (from elsewhere)"
        )
    if args.store is not None and args.learner_id is None:
        raise ConfigError("--store needs --learner-id; use --join URL to pick a free id automatically")
    return args.store or args.join, check_site(args.site) if args.site is not None else default_site()
